"""Drives text-generation-webui's (TGW) own code with the Kestrel loader installed.

Run by tests/tgw/test_tgw.py in a fresh interpreter, with the TGW tree as working directory:
TGW parses sys.argv and patches transformers at import, which must not leak into the
test process. Usage: python tgw_driver.py TGW_ROOT MODEL_DIR MODEL_NAME LORA_DIR LORA_NAME
Prints one JSON object (what TGW returned at each step) on its last line of stdout.
"""

from __future__ import annotations

import copy
import importlib
import json
import logging
import os
import sys
import threading
import traceback
from pathlib import Path

# GBNF grammars from llama.cpp's grammars folder (tests/data/constrained).
GRAMMARS = Path(__file__).resolve().parents[1] / "data" / "constrained"


def main(root: str, model_dir: str, model_name: str, lora_dir: str, lora_name: str) -> dict:
    os.chdir(root)
    sys.path.insert(0, root)
    sys.argv = ["server.py", "--loader", "kestrel", "--cpu", "--ctx-size", "192"]
    sys.argv += ["--model-dir", model_dir, "--lora-dir", lora_dir]
    import modules.shared as shared
    from modules import LoRA, loaders, logits, models, models_settings, text_generation

    out: dict = {"loader_arg": shared.args.loader}
    out["loader_params"] = loaders.loaders_and_params.get("Kestrel")

    shared.generation_lock = threading.Lock()  # server.py creates it
    shared.model, shared.tokenizer = models.load_model(model_name)
    model = shared.model
    out["model_class"] = type(model).__name__
    out["tokenizer_is_model"] = shared.tokenizer is model
    out["truncation_length"] = shared.settings["truncation_length"]
    out["model_max_seq_len"] = model.max_seq_len

    prompt = "Once upon a time"
    state = copy.deepcopy(shared.settings)
    state.update(max_new_tokens=12, auto_max_new_tokens=False, do_sample=False, seed=7)
    state["stream"] = True
    state["truncation_length"] = shared.settings["truncation_length"]

    def reply(state: dict) -> list[str]:
        return list(text_generation.generate_reply(prompt, state, is_chat=False))

    out["stream"] = reply(state)
    # Not streaming: TGW calls model.generate(); with a stop string TGW streams and cuts.
    out["no_stream"] = reply(dict(state, stream=False))
    cut = out["stream"][-1][3:6]
    out["stop_string"] = cut
    out["stopped_reply"] = reply(dict(state, custom_stopping_strings=json.dumps(cut)))[-1]

    # Two requests at once (as the API sends them, with a stop_event): TGW lets them run in
    # parallel for Kestrel, whose scheduler batches them.
    results: dict[int, str] = {}

    def worker(i: int) -> None:
        own = dict(state, stop_event=threading.Event())
        results[i] = list(text_generation.generate_reply(prompt, own, is_chat=False))[-1]

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out["parallel"] = [results.get(0), results.get(1)]
    out["encoded"] = text_generation.encode(prompt).tolist()
    out["prompt_tokens"] = model.last_prompt_token_count

    # TGW's Stop button: shared.stop_everything ends the stream at the next token.
    long_state = dict(state, max_new_tokens=20)
    seen = []
    for text in model.generate_with_streaming(prompt, long_state):
        seen.append(text)
        if len(seen) == 2:
            shared.stop_everything = True
    shared.stop_everything = False
    out["stopped_after"] = len(seen)
    stop_event = threading.Event()
    seen = []
    for text in model.generate_with_streaming(prompt, dict(long_state, stop_event=stop_event)):
        seen.append(text)
        stop_event.set()
    out["stop_event_after"] = len(seen)
    out["running_after_stop"] = model.loaded.info()["scheduler"]

    probs = logits.get_next_logits(prompt, state, False, "", 5, True)
    out["next_token_probs"] = probs
    sampling = dict(state, do_sample=True, temperature=1.0, top_k=3)
    out["sampled_probs"] = logits.get_next_logits(prompt, sampling, True, "", 5, True)

    # Settings Kestrel ignores are named through TGW's own logger (its console).
    warnings: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            warnings.append(record.getMessage())

    from modules.logging_colors import logger

    handler = Collect(level=logging.WARNING)
    logger.addHandler(handler)
    ignored = dict(state, guidance_scale=1.5, negative_prompt="no")
    reply(dict(ignored, adaptive_target=0.5))
    logger.removeHandler(handler)
    out["warnings"] = warnings

    # TGW's grammar box (Parameters): the GBNF text travels in the state as grammar_string,
    # TGW hands it to the loader untouched, and Kestrel constrains the job with it.
    grammar = (GRAMMARS / "list.gbnf").read_text()
    constrained = dict(state, grammar_string=grammar, max_new_tokens=24)
    out["grammar"] = grammar
    out["grammar_greedy"] = reply(constrained)[-1]
    out["grammar_sampled"] = reply(dict(constrained, do_sample=True, temperature=1.0))[-1]

    # Logprobs through TGW's own API code (modules/api since v4.3, extensions/openai before).
    # It imports packages only TGW's environment has (markdown, tiktoken, ...).
    try:
        package = "modules.api" if os.path.isdir("modules/api") else "extensions.openai"
        completions = importlib.import_module(f"{package}.completions")
        typing = importlib.import_module(f"{package}.typing")
    except ModuleNotFoundError as e:
        out["api_unavailable"] = f"{e} (run the driver with TGW's own Python)"
    else:
        body = {"prompt": prompt, "max_tokens": 6, "temperature": 0, "logprobs": 3, "seed": 7}
        request = typing.CompletionRequest(**body)  # as TGW's endpoint validates a request
        response = completions.completions(typing.to_dict(request))
        out["api_text"] = response["choices"][0]["text"]
        out["api_logprobs"] = response["choices"][0]["logprobs"]

    os.makedirs(os.path.join(model_dir, "Some-Model-exl2"), exist_ok=True)
    out["inferred_exl2"] = models_settings.infer_loader("Some-Model-exl2", {})

    try:
        LoRA.add_lora_to_model([lora_name])
        out["lora"] = {"status": "applied", "lora_names": list(shared.lora_names)}
        out["lora"]["stream"] = reply(state)
        LoRA.add_lora_to_model([])
        out["lora"]["lora_names_after_removal"] = list(shared.lora_names)
        out["lora"]["stream_after_removal"] = reply(state)
    except Exception as e:
        cause = e.__cause__
        out["lora"] = {
            "status": "error",
            "type": type(e).__name__,
            "cause_type": type(cause).__name__ if cause is not None else None,
            "message": str(e),
            "lora_names": list(shared.lora_names),
            "traceback": traceback.format_exc(),
        }

    models.unload_model()
    out["unloaded"] = shared.model is None and model.model is None

    # TGW's llama.cpp cache-type name for 8-bit K/V loads Kestrel's q8 cache.
    shared.args.cache_type = "q8_0"
    shared.model, shared.tokenizer = models.load_model(model_name)
    out["q8_0_cache"] = shared.model.loaded.info().get("cache_type")
    models.unload_model()
    return out


if __name__ == "__main__":
    result = main(*sys.argv[1:6])
    print(json.dumps(result))
