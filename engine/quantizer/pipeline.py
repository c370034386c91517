"""convert(): an FP16/BF16 HF model (or a GGUF file) -> an EXL2 model directory.

    from engine.quantizer import ConvertOptions, convert
    result = convert("models/fp16", "models/exl2-4.0", ConvertOptions(bits=4.0))

Stages, each resumable from OUT.partial (engine/quantizer/job.py):
  tokenize -> measure (per layer, unquantized states) -> optimize (bits per module for
  the target) -> quantize (per layer, quantized states) -> head -> compile -> rename to OUT.
  With `rtn` the quantize and head stages read the weights alone (no states: rounding to
  nearest does not look at inputs).

Contract:
- Everything that can be checked from the arguments, the config and the file headers is
  checked before any work and raises `ConvertError` (a ValueError) with nothing written:
  bits outside 2.0-8.0 or not reachable for this model's shapes, head bits not in
  {2, 3, 4, 5, 6, 8}, a missing input, an architecture the quantizer does not support,
  an unreadable calibration or measurement file, an existing non-empty OUT. A GGUF input
  is imported first (into OUT.partial/input); if it then fails a check, OUT.partial goes.
- OUT appears complete (one rename) or not at all. A killed run leaves OUT.partial; the
  same command resumes it (finished layers are not redone); `resume=False` starts over.
- On a CPU, torch runs `threads` threads during the call (default: the cores the load
  average leaves idle, engine/quantizer/threads.py); the caller's count is restored.
- `stop_after_layers=N` stops (finished=False) after N layer steps (measured or
  quantized) in this call: the Python-level stand-in for a kill, for tests.
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from engine.config import ConfigError, ModelConfig
from engine.cpu_threads import cpu_threads
from engine.loading import overflows_float16, resolve_device
from engine.quantizer import calibration as cal
from engine.quantizer.gptq import DEFAULT_DAMP
from engine.quantizer.job import Job, JobMismatchError, atomic_write_text
from engine.quantizer.measure import ERROR_REFERENCES, gptq_runs, measure_layer, scoring_rows
from engine.quantizer.model import (
    CalibrationRunner,
    LayerwiseModel,
    UnsupportedModelError,
    supported_for_conversion,
)
from engine.quantizer.optimize import DEFAULT_NORM, BudgetError
from engine.quantizer.profiles import HEAD_PROFILES
from engine.quantizer.quantize import (
    quantize_head,
    quantize_layer,
    rtn_quantize_head,
    rtn_quantize_layer,
)
from engine.quantizer.sensitivity import (
    REFERENCE_RUNG,
    SENSITIVITIES,
    SensitivityProbe,
    probe_shape,
    sensitivity_record,
)
from engine.quantizer.shrink_choice import (
    MIN_HELDOUT_TOKENS,
    SHRINK_LADDER,
    best_shrink,
    heldout_loss,
    heldout_row_count,
    next_shrink,
)
from engine.quantizer.strategy import (
    MEASUREMENT_FORMAT,
    check_measurement,
    check_target_feasible,
    choose_strategy,
    model_signature,
    read_measurement,
    written_bpw,
)
from engine.quantizer.threads import idle_cpu_threads
from engine.quantizer.writer import publish, write_output
from engine.weights import WeightError

# A measurement record (engine/quantizer/strategy.py: read_measurement), as JSON reads it.
Measurement = dict[str, Any]

QUANTIZER_VERSION = "kestrel-0.1.0"
MIN_BITS, MAX_BITS = 2.0, 8.0
MAX_DAMP = 10.0  # beyond this GPTQ is rounding to nearest with extra steps
MAX_SHRINK = 100.0  # H nearly diagonal: error feedback along the diagonal alone
AUTO_SHRINK = "auto"  # ConvertOptions.shrink: chosen per model (shrink_choice.py)
MAX_TOKEN_POWER = 8.0  # past it a few worst tokens alone decide
MIN_NORM, MAX_NORM = 1.0, 16.0  # 16: the largest error alone decides, for any practical table
# (rows, length, measure rows, measure length) per device. The defaults put quality first;
# `fast` is the earlier default, for quick tries (SmolLM2-135M in about 8 minutes on two
# loaded CPU cores). Issue 29's measurements (README, "Quantize a model"): the mixed
# calibration text is most of the gain on multilingual text and code; on a CPU the default
# also scores measurement candidates on every measurement row (every source of the mix)
# rather than on the first SCORE_TOKENS_CPU tokens, which costs about twice the time.
DEFAULT_ROWS = {"cuda": (64, 2048, 12, 2048), "cpu": (16, 512, 8, 512)}
FAST_ROWS = {"cuda": (32, 2048, 8, 2048), "cpu": (16, 512, 8, 512)}
# With `fast` on a CPU, measurement candidates are scored on the first rows holding this
# many tokens (measure.py); the defaults score every row, as on a GPU.
SCORE_TOKENS_CPU = 1024


class ConvertError(ValueError):
    """The conversion cannot start (or go on) with these inputs; nothing was left behind."""


class ConversionStopped(Exception):
    pass


@dataclass
class ConvertOptions:
    bits: float
    head_bits: int = 6
    # .txt/.jsonl/.parquet file(s), one source each (rows interleave); None: the shipped mix
    calibration: str | Path | Sequence[str | Path] | None = None
    rows: int | None = None  # None: per-device default (DEFAULT_ROWS, FAST_ROWS when fast)
    length: int | None = None
    measure_rows: int | None = None
    measure_length: int | None = None
    measurement_out: str | Path | None = None  # save the measurement here
    measure_only: bool = False  # stop after saving it (exllamav2's -om); OUT is not made
    measurement_in: str | Path | None = None
    fast: bool = False  # FAST_ROWS instead of DEFAULT_ROWS where rows/lengths are not given
    resume: bool = True
    device: str | None = None
    # GPTQ damping: this fraction of the Hessian's mean diagonal is added to its diagonal
    # (measuring and quantizing; a reused measurement keeps the damping it was made with).
    damp: float = DEFAULT_DAMP
    # GPTQ's Hessian shrunk toward its diagonal, H + shrink * diag(H), before the damping
    # (gptq.py's contract says why). A number: that shrinkage, measuring and quantizing
    # (0: plain GPTQ). "auto": chosen per model (shrink_choice.py): measured at 0, then
    # quantized at two or three rungs, keeping the one whose held-out calibration rows
    # read best, since what helps one model costs another (SmolLM2-135M gained on every
    # domain, Gemma-3-270M lost). None: "auto" for the user's own calibration text, 0 for
    # the shipped mix (broad already: 0.3 cost SmolLM2 0.4-2.5% there) and with `fast` or
    # `rtn` (a quick try makes one pass).
    shrink: float | str | None = None
    # The bit allocation minimizes Σ err^error_norm over the measured modules (optimize.py).
    error_norm: float = DEFAULT_NORM
    # How a measurement scores candidates (measure.py; measuring only, so not with -m):
    # against the layer's output stream or the stream right after each module, and on the
    # last `heldout` fraction of the measuring rows with Hessians from the others (0: off).
    error_reference: str = "layer"
    heldout: float = 0.0
    # Each candidate's error a power mean of this power over the scored tokens (1: the
    # mean; larger weighs a module's worst tokens more: measure.py). Measuring only.
    token_power: float = 1.0
    # How the allocation weighs each module's errors (sensitivity.py): "kl" by what its
    # noise costs at the model's output, probed while measuring (and, with -m, when the
    # measurement holds the probe's result); "off" as measured.
    sensitivity: str = "kl"
    rtn: bool = False  # round to nearest instead of GPTQ (a baseline for comparisons)
    shard_mb: int = 8192
    progress: bool = True
    # Hears each bar's state as "<stage> <done>/<total> <unit>" (the web UI's banner while
    # the default model is prepared), whether or not the bars are shown.
    listener: Callable[[str], None] | None = None
    stop_after_layers: int | None = None
    threads: int | None = None  # torch CPU threads meanwhile; None: on a CPU, the idle cores


@dataclass
class ConvertResult:
    output: Path | None
    finished: bool
    bpw: float | None = None  # decoder linears, from the written tensors
    resumed: bool = False
    measured_now: list[int] = field(default_factory=list)
    quantized_now: list[int] = field(default_factory=list)
    seconds: float = 0.0


def convert(input_path: str | Path, output: str | Path, options: ConvertOptions) -> ConvertResult:
    started = time.perf_counter()
    src, out = Path(input_path).expanduser(), Path(output).expanduser()
    partial = out.with_name(out.name + ".partial")
    _check_options(options)
    try:
        device = resolve_device(options.device)
    except ValueError as e:
        raise ConvertError(str(e)) from None
    if not src.exists():
        raise ConvertError(f"input not found: {src}")
    is_gguf = src.is_file() and src.suffix.lower() == ".gguf"
    if not is_gguf and not src.is_dir():
        raise ConvertError(f"input must be a model directory or a .gguf file: {src}")
    if not is_gguf and (out.resolve() == src.resolve() or src.resolve() in out.resolve().parents):
        # The output (and OUT.partial) would become part of the model being read.
        raise ConvertError(f"output {out} lies inside the input directory {src}; choose another -o")
    if not options.measure_only and out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConvertError(f"output {out} already exists; choose another -o or remove it")
    texts, dataset = _calibration(options)
    measurement = _read_measurement_file(options)
    if not is_gguf:
        _check_model(src, options, measurement)

    rows, length, mrows, mlength = _row_settings(options, device)
    settings = {
        "input": str(src.resolve()),
        "bits": options.bits,
        "head_bits": options.head_bits,
        "rows": rows,
        "length": length,
        "measure_rows": mrows,
        "measure_length": mlength,
        "dataset": dataset,
        # A resumed job must calibrate on the same text, whatever the file is called.
        "calibration_sha256": hashlib.sha256("\0".join(texts).encode()).hexdigest(),
        "measurement_in": (
            str(Path(options.measurement_in).resolve()) if options.measurement_in else None
        ),
        "damp": options.damp,
        "rtn": options.rtn,
        "score_tokens": _score_tokens(options, device),
    }
    # Each only when set: an OUT.partial from before the option existed still resumes.
    if _shrink_setting(options) != 0.0:
        settings["shrink"] = _shrink_setting(options)
    if options.error_norm != DEFAULT_NORM:
        settings["error_norm"] = options.error_norm
    if options.error_reference != "layer":
        settings["error_reference"] = options.error_reference
    if options.heldout:
        settings["heldout"] = float(options.heldout)
    if options.token_power != 1:
        settings["token_power"] = float(options.token_power)
    if options.sensitivity != "off":
        settings["sensitivity"] = options.sensitivity
    if (
        options.shrink is None
        and settings.get("shrink") == AUTO_SHRINK
        and "shrink" not in (Job.saved_settings(partial) or {"shrink": None})
    ):
        # A job begun before the shrinkage was chosen by default resumes as it began:
        # plain GPTQ (its settings hold no shrinkage), instead of a mismatch error.
        del settings["shrink"]
    try:
        job = Job.open(partial, settings, resume=options.resume)
    except JobMismatchError as e:
        raise ConvertError(str(e)) from None
    result = ConvertResult(output=None, finished=False, resumed=job.resumed)
    model_dir = src
    if is_gguf:
        model_dir = job.path / "input"
        try:
            if not (model_dir / "config.json").is_file():
                from engine.gguf_import import import_gguf

                import_gguf(src, model_dir, progress=options.progress)
            _check_model(model_dir, options, measurement)
        except (ValueError, FileNotFoundError) as e:  # ConvertError is a ValueError
            if not job.resumed:
                shutil.rmtree(job.path, ignore_errors=True)
            raise e if isinstance(e, ConvertError) else ConvertError(str(e)) from e

    threads = options.threads or (idle_cpu_threads() if device.type == "cpu" else None)
    if device.type == "cpu" and not options.threads:
        _say(options, f"{threads} CPU thread(s): the idle cores (--threads to choose)")
    try:
        with cpu_threads(threads) if threads else nullcontext():
            _run(job, model_dir, out, options, device, texts, measurement, _Steps(options), result)
    except ConversionStopped:
        pass
    except WeightError as e:  # found only when the layer is read (a NaN weight, say)
        raise ConvertError(f"{e} (the work so far stays in {job.path})") from None
    result.seconds = time.perf_counter() - started
    return result


class _Steps:
    """Counts layer steps of this call, for stop_after_layers."""

    def __init__(self, options: ConvertOptions) -> None:
        self.limit, self.count = options.stop_after_layers, 0

    def done(self) -> None:
        self.count += 1
        if self.limit is not None and self.count >= self.limit:
            raise ConversionStopped


def _check_options(o: ConvertOptions) -> None:
    if not isinstance(o.bits, (int, float)) or not MIN_BITS <= float(o.bits) <= MAX_BITS:
        raise ConvertError(f"bits per weight must lie in {MIN_BITS}-{MAX_BITS}, got {o.bits}")
    if o.head_bits not in HEAD_PROFILES:
        raise ConvertError(
            f"head bits must be one of {', '.join(map(str, HEAD_PROFILES))}, got {o.head_bits}"
        )
    for name in ("rows", "length", "measure_rows", "measure_length"):
        value = getattr(o, name)
        if value is not None and (not isinstance(value, int) or value <= 0):
            raise ConvertError(f"{name} must be a positive integer, got {value!r}")
    if o.measurement_in and o.measurement_out:
        raise ConvertError("pass either a measurement to reuse (-m) or one to save (-om)")
    if o.measure_only and not o.measurement_out:
        raise ConvertError("measure_only needs measurement_out, the file to save it in")
    if not isinstance(o.damp, (int, float)) or not 0 < float(o.damp) <= MAX_DAMP:
        raise ConvertError(f"damping must lie in (0, {MAX_DAMP:g}], got {o.damp}")
    if (
        o.shrink is not None
        and o.shrink != AUTO_SHRINK
        and (not isinstance(o.shrink, (int, float)) or not 0 <= float(o.shrink) <= MAX_SHRINK)
    ):
        raise ConvertError(
            f"the Hessian shrinkage must be {AUTO_SHRINK!r} or lie in [0, {MAX_SHRINK:g}], "
            f"got {o.shrink!r}"
        )
    if not isinstance(o.error_norm, (int, float)) or not MIN_NORM <= o.error_norm <= MAX_NORM:
        raise ConvertError(
            f"the error norm must lie in {MIN_NORM:g}-{MAX_NORM:g}, got {o.error_norm}"
        )
    if o.error_reference not in ERROR_REFERENCES:
        raise ConvertError(
            f"the error reference must be one of {', '.join(ERROR_REFERENCES)}, "
            f"got {o.error_reference!r}"
        )
    if not isinstance(o.heldout, (int, float)) or not 0 <= o.heldout < 1:
        raise ConvertError(f"the held-out fraction must lie in [0, 1), got {o.heldout}")
    if o.heldout and o.measure_rows is not None and o.measure_rows < 2:
        raise ConvertError(
            f"held-out scoring needs at least 2 measuring rows (-mr), got {o.measure_rows}"
        )
    if not isinstance(o.token_power, (int, float)) or not 1 <= o.token_power <= MAX_TOKEN_POWER:
        raise ConvertError(
            f"the token power must lie in 1-{MAX_TOKEN_POWER:g}, got {o.token_power}"
        )
    if o.measurement_in and (o.error_reference != "layer" or o.heldout or o.token_power != 1):
        # They decide how a measurement is made; a reused one keeps what it was made with.
        raise ConvertError(
            "--error_reference, --heldout_scoring and --token_power choose how a measurement "
            "is made; -m reuses one as it was made (drop them, or measure again)"
        )
    if o.sensitivity not in SENSITIVITIES:
        raise ConvertError(
            f"the sensitivity must be one of {', '.join(SENSITIVITIES)}, got {o.sensitivity!r}"
        )
    if o.shard_mb <= 0:
        raise ConvertError(f"shard size must be positive, got {o.shard_mb} MB")
    if o.threads is not None and (not isinstance(o.threads, int) or o.threads <= 0):
        raise ConvertError(f"threads must be a positive integer, got {o.threads!r}")


def _calibration(o: ConvertOptions) -> tuple[list[str], str]:
    if o.calibration is None:
        return cal.default_calibration_texts(), cal.DEFAULT_DATASET_NAME
    paths = [o.calibration] if isinstance(o.calibration, (str, Path)) else list(o.calibration)
    try:
        return cal.read_calibration_texts(paths), " + ".join(Path(p).name for p in paths)
    except cal.CalibrationError as e:
        raise ConvertError(str(e)) from None


def _read_measurement_file(o: ConvertOptions) -> Measurement | None:
    if o.measurement_in is None:
        return None
    try:
        measurement: Measurement = read_measurement(Path(o.measurement_in).expanduser())
        return measurement
    except ValueError as e:
        raise ConvertError(str(e)) from None


def _check_model(model_dir: Path, o: ConvertOptions, measurement: Measurement | None) -> None:
    try:
        config = ModelConfig.from_dir(model_dir)
        supported_for_conversion(config)
        lm = LayerwiseModel(model_dir, device=torch.device("cpu"), dtype=torch.float32)
        check_target_feasible(lm, float(o.bits))
        if measurement is not None:
            check_measurement(lm, measurement, str(o.measurement_in))
    except (ConfigError, UnsupportedModelError, BudgetError) as e:
        raise ConvertError(str(e)) from None
    except ValueError as e:
        raise ConvertError(f"{model_dir}: {e}") from None


def _row_settings(o: ConvertOptions, device: torch.device) -> tuple[int, int, int, int]:
    table = FAST_ROWS if o.fast else DEFAULT_ROWS
    r, ln, mr, ml = table["cuda" if device.type == "cuda" else "cpu"]
    return (o.rows or r, o.length or ln, o.measure_rows or mr, o.measure_length or ml)


def _shrink_setting(o: ConvertOptions) -> float | str:
    """The shrinkage this conversion quantizes with, or "auto" (chosen per model)."""
    if o.shrink == AUTO_SHRINK:
        return 0.0 if o.rtn else AUTO_SHRINK
    if o.shrink is not None:
        return float(o.shrink)
    return 0.0 if o.fast or o.rtn or o.calibration is None else AUTO_SHRINK


def _measure_shrink(o: ConvertOptions) -> float:
    """The shrinkage the measurement uses: a chosen one is chosen after it, from 0."""
    setting = _shrink_setting(o)
    return 0.0 if setting == AUTO_SHRINK else float(setting)


def _score_tokens(o: ConvertOptions, device: torch.device) -> int | None:
    return SCORE_TOKENS_CPU if o.fast and device.type == "cpu" else None


def _say(o: ConvertOptions, message: str) -> None:
    if o.progress:
        tqdm.write(message)


def _bar(o: ConvertOptions, **kwargs: Any) -> Any:
    """A tqdm bar (tqdm ships no type information: Any)."""
    if o.listener is None:
        return tqdm(disable=not o.progress, dynamic_ncols=True, **kwargs)
    return _ReportingBar(o.listener, disable=not o.progress, dynamic_ncols=True, **kwargs)


class _ReportingBar(tqdm):  # type: ignore[misc]  # tqdm ships no type information
    """A tqdm bar that also tells a listener where it is (a disabled one too)."""

    def __init__(self, listener: Callable[[str], None], **kwargs: Any) -> None:
        self._listener = listener
        self._stage = kwargs.get("desc", "")
        self._unit = kwargs.get("unit", "it")
        self._done = kwargs.get("initial", 0)
        self._total = kwargs.get("total")
        super().__init__(**kwargs)
        self._tell()

    def update(self, n: float | None = 1) -> bool | None:
        self._done += n or 0
        self._tell()
        shown: bool | None = super().update(n)
        return shown

    def _tell(self) -> None:
        total = f"/{self._total}" if self._total else ""
        self._listener(f"{self._stage} {int(self._done)}{total} {self._unit}")


def _run(
    job: Job,
    model_dir: Path,
    out: Path,
    o: ConvertOptions,
    device: torch.device,
    texts: list[str],
    measurement: Measurement | None,
    steps: _Steps,
    result: ConvertResult,
) -> None:
    s = job.settings
    lm = LayerwiseModel(model_dir, device=device, dtype=forward_dtype(model_dir, device))
    n = lm.num_layers
    full_search = "full" if device.type == "cuda" else "fast"
    measure_search = "full" if device.type == "cuda" else "coarse"

    # -- tokenize ----------------------------------------------------------------------
    if not job.has("calibration.safetensors"):
        from engine.tokenizer import Tokenizer

        tokenizer = Tokenizer.from_dir(model_dir)
        with _bar(o, total=2, desc="tokenize", unit="set") as bar:
            try:
                # Held-out rows (shrinkage chosen per model) continue the quantizing rows,
                # so the Hessians never see them.
                extra = (
                    heldout_row_count(s["rows"], s["length"])
                    if s.get("shrink") == AUTO_SHRINK and not o.measure_only
                    else 0
                )
                quant_rows = cal.calibration_rows(tokenizer, texts, s["rows"] + extra, s["length"])
                heldout_rows = quant_rows[s["rows"] :]
                quant_rows = quant_rows[: s["rows"]]
                bar.update()
                mids = cal.calibration_rows(
                    tokenizer, texts, s["measure_rows"], s["measure_length"]
                )
                bar.update()
            except cal.CalibrationError as e:
                if not job.resumed:
                    shutil.rmtree(job.path, ignore_errors=True)
                raise ConvertError(str(e)) from None
        if s.get("heldout") and mids.shape[0] < 2:
            if not job.resumed:
                shutil.rmtree(job.path, ignore_errors=True)
            raise ConvertError(
                "held-out scoring needs at least 2 measuring rows; the calibration text "
                f"gives {mids.shape[0]} of {s['measure_length']} tokens"
            )
        for what, got, want in (
            ("rows", quant_rows, s["rows"]),
            ("measure rows", mids, s["measure_rows"]),
        ):
            if got.shape[0] < want:
                _say(o, f"note: the calibration text gives {got.shape[0]} {what}, not {want}")
        if extra and heldout_rows.shape[0] < extra:
            # Too few tokens and the rungs' small differences are noise: plain GPTQ then.
            enough = heldout_rows.numel() >= MIN_HELDOUT_TOKENS // 2
            _say(
                o,
                f"note: the calibration text leaves {heldout_rows.shape[0]} held-out rows, "
                f"not {extra}" + ("" if enough else ", too few to choose by: shrinkage 0"),
            )
            if not enough:
                heldout_rows = heldout_rows[:0]
        saved = {"rows": quant_rows, "measure_rows": mids}
        if heldout_rows.shape[0]:
            saved["heldout_rows"] = heldout_rows
        job.save_tensors("calibration.safetensors", saved)
    ids = job.load_tensors("calibration.safetensors")

    # -- measure -----------------------------------------------------------------------
    if measurement is None:
        measurement = _measure(job, lm, ids["measure_rows"], o, measure_search, steps, result)
    if o.measurement_out:
        atomic_write_text(Path(o.measurement_out).expanduser(), json.dumps(measurement, indent=1))
        if o.measure_only:
            shutil.rmtree(job.path, ignore_errors=True)
            result.finished = True
            _say(o, f"wrote the measurement to {o.measurement_out}")
            return

    # -- optimize ----------------------------------------------------------------------
    if job.get("strategy") is None:
        norm = float(s.get("error_norm", DEFAULT_NORM))
        weighed = s.get("sensitivity", "off") == "kl" and "sensitivity" in measurement
        if s.get("sensitivity", "off") == "kl" and not weighed:
            _say(o, "note: the measurement holds no sensitivity probe: errors as measured")
        strategy, predicted, objective = choose_strategy(
            lm, measurement, float(s["bits"]), error_norm=norm, sensitivity=weighed
        )
        job.update(strategy=strategy, predicted_bpw=predicted)
        what = "predicted KL (nats/token)" if weighed else "Σ err²"
        _say(
            o,
            f"strategy: {predicted:.4f} bpw for the decoder, {what} {objective:.5f} "
            f"(minimizing Σ err^{norm:g})",
        )
    strategy = job.get("strategy")

    # -- quantize ----------------------------------------------------------------------
    rows = ids["rows"]
    # Chosen among passes when asked and the text left rows to hold out (else plain GPTQ).
    chosen = s.get("shrink") == AUTO_SHRINK and "heldout_rows" in ids
    shrink = 0.0
    if o.rtn:
        _quantize_rtn(job, lm, strategy, o, full_search, steps, result)
    elif chosen:
        shrink = _quantize_choosing_shrink(
            job, lm, rows, ids["heldout_rows"], strategy, o, full_search, steps, result
        )
    else:
        if s.get("shrink") != AUTO_SHRINK:
            shrink = float(s.get("shrink", 0.0))
        _quantize_gptq(job, lm, rows, strategy, o, full_search, steps, result, shrink=shrink)
    tag = _shrink_tag(shrink) if chosen else ""

    # -- compile -----------------------------------------------------------------------
    written: dict[str, torch.Tensor] = {}
    with _bar(o, total=n + 2, desc="compile", unit="file") as bar:
        for i in range(n):
            written.update(job.load_tensors(Job.layer_file(i, tag)))
            bar.update()
        written.update(job.load_tensors(f"head{tag}.safetensors"))
        for name in ("model.embed_tokens.weight", "model.norm.weight"):
            written[name] = lm.store.get(name, dtype=torch.float16)
        bpw = written_bpw(written, lm)
        qcfg = {
            "quant_method": "exl2",
            "version": QUANTIZER_VERSION,
            "bits": float(s["bits"]),
            "head_bits": s["head_bits"],
            "achieved_bits": round(bpw, 4),
            **({} if o.rtn else {"hessian_shrink": shrink}),
            # How the shrinkage was chosen: held-out perplexity per tried shrinkage.
            **({"hessian_shrink_heldout_ppl": _trial_ppl(job)} if chosen else {}),
            "calibration": {"rows": int(rows.shape[0]), "length": int(rows.shape[1]),
                            "dataset": s["dataset"]},
        }  # fmt: skip
        write_output(job.path / "final", written, model_dir, qcfg, shard_bytes=o.shard_mb << 20)
        bar.update(2)
    publish(job.path / "final", out)
    shutil.rmtree(job.path, ignore_errors=True)
    result.output, result.finished, result.bpw = out, True, bpw
    _say(o, f"wrote {out}: {bpw:.4f} bpw (decoder), head {s['head_bits']} bits")


def _shrink_tag(shrink: float) -> str:
    """The suffix of one shrinkage's quantizing pass (its states, layer files, head)."""
    return f"-s{shrink:g}"


def _quantize_choosing_shrink(
    job: Job,
    lm: LayerwiseModel,
    rows: torch.Tensor,
    heldout: torch.Tensor,
    strategy: list[dict[str, dict[str, str]]],
    o: ConvertOptions,
    search: str,
    steps: _Steps,
    result: ConvertResult,
) -> float:
    """One quantizing pass per rung of shrink_choice's ladder; returns the chosen rung, whose
    pass is kept (the others' files are removed as soon as they lose)."""
    trials = {float(k): float(v) for k, v in job.get("shrink_losses", {}).items()}
    if not trials:
        rungs = [f"{r:g}" for r in SHRINK_LADDER]
        _say(
            o,
            f"choosing GPTQ's Hessian shrinkage (--shrink auto): a quantizing pass at "
            f"{' and '.join(rungs[:2])}, then at {', '.join(rungs[2:])} only while the last "
            "pass lowered the held-out loss; "
            f"the pass whose {heldout.shape[0]} held-out rows of the calibration text read "
            "best is kept",
        )
    while (shrink := next_shrink(trials)) is not None:
        loss = _quantize_gptq(
            job, lm, rows, strategy, o, search, steps, result,
            shrink=shrink, tag=_shrink_tag(shrink), heldout=heldout,
        )  # fmt: skip
        assert loss is not None
        trials[shrink] = loss
        job.update(shrink_losses={f"{k:g}": v for k, v in trials.items()})
        _say(o, f"shrinkage {shrink:g}: held-out perplexity {math.exp(loss):.3f}")
        best = best_shrink(trials)
        for tried in trials:
            if tried != best:
                _remove_pass(job, _shrink_tag(tried))
    best = best_shrink(trials)
    if job.get("shrink") != best:
        job.update(shrink=best)
        table = ", ".join(f"{k:g}: {math.exp(v):.3f}" for k, v in sorted(trials.items()))
        _say(o, f"shrinkage {best:g} chosen (held-out perplexity by shrinkage: {table})")
    return best


def _trial_ppl(job: Job) -> dict[str, float | None]:
    """Held-out perplexity per tried shrinkage (None where the loss was not finite)."""
    losses = job.get("shrink_losses", {})
    return {k: round(math.exp(v), 4) if math.isfinite(v) else None for k, v in losses.items()}


def _remove_pass(job: Job, tag: str) -> None:
    shutil.rmtree(job.path / f"layers{tag}", ignore_errors=True)
    (job.path / f"head{tag}.safetensors").unlink(missing_ok=True)


def _quantize_gptq(
    job: Job,
    lm: LayerwiseModel,
    rows: torch.Tensor,
    strategy: list[dict[str, dict[str, str]]],
    o: ConvertOptions,
    search: str,
    steps: _Steps,
    result: ConvertResult,
    *,
    shrink: float,
    tag: str = "",
    heldout: torch.Tensor | None = None,
) -> float | None:
    """GPTQ, layer by layer, each fed the states of the already-quantized layers before it.
    With `heldout` token rows, their states go through each quantized layer too and the
    pass returns their mean next-token loss (nats) through the quantized head."""
    n = lm.num_layers
    stage = "quant" + tag
    layers_key, head_key, loss_key = (f"quantized_layers{tag}", f"head_done{tag}",
                                      f"heldout_loss{tag}")  # fmt: skip
    if job.get(head_key) and (heldout is None or job.get(loss_key) is not None):
        recorded = job.get(loss_key)
        return None if recorded is None else float(recorded)
    runner = CalibrationRunner(lm, length=rows.shape[1], chunk_rows=_chunk_rows(rows, lm.device))
    done = job.get(layers_key, 0)
    held = None
    if done < n:
        if done:
            states = job.load_states(stage, done)
            held = job.load_state_extras(stage, done).get("heldout")
        else:
            states = lm.embed(rows).cpu()
            held = lm.embed(heldout).cpu() if heldout is not None else None
        desc = "quantize" if not tag else f"quantize (shrinkage {shrink:g})"
        with _bar(o, total=n, initial=done, desc=desc, unit="layer") as bar:
            for i in range(done, n):
                lm.load_layer(i)
                states, tensors, errors = quantize_layer(
                    runner, i, states, strategy[i], scale_search=search, damp=o.damp,
                    shrink=shrink,
                )  # fmt: skip
                if held is not None:
                    held = runner.run_layer(i, held).cpu()
                lm.unload_layer(i)
                _check_finite(lm, i, states)
                job.save_tensors(Job.layer_file(i, tag), tensors)
                extra = {"heldout": held} if held is not None else None
                job.advance_states(stage, i + 1, states, extra=extra, **{layers_key: i + 1})
                result.quantized_now.append(i)
                bar.set_postfix(max_err=f"{max(errors.values()):.4f}")
                bar.update()
                steps.done()
    states = job.load_states(stage, n)
    if heldout is not None and held is None:
        held = job.load_state_extras(stage, n).get("heldout")
    with _bar(o, total=1, desc="lm_head", unit="linear") as bar:
        head, err, head_weight = quantize_head(
            lm, runner, states, job.settings["head_bits"], scale_search=search, damp=o.damp,
            shrink=shrink,
        )  # fmt: skip
        bar.set_postfix(err=f"{err:.4f}")
        bar.update()
    loss = None
    if heldout is not None:
        assert held is not None
        loss = heldout_loss(lm, held, head_weight, heldout)
    job.save_tensors(f"head{tag}.safetensors", head)
    job.update(**{head_key: True, loss_key: loss})
    if tag:  # a finished pass needs its states no more
        (job.path / Job.states_file(stage, n)).unlink(missing_ok=True)
    return loss


def _quantize_rtn(
    job: Job,
    lm: LayerwiseModel,
    strategy: list[dict[str, dict[str, str]]],
    o: ConvertOptions,
    search: str,
    steps: _Steps,
    result: ConvertResult,
) -> None:
    """Round to nearest: the weights alone, no calibration forwards and no hidden states
    (they would not change a code; on an H100 they were most of a 135M model's 84 s)."""
    n = lm.num_layers
    done = job.get("quantized_layers", 0)
    with _bar(o, total=n, initial=done, desc="quantize (rtn)", unit="layer") as bar:
        for i in range(done, n):
            lm.load_layer(i)
            tensors, errors = rtn_quantize_layer(lm, i, strategy[i], scale_search=search)
            lm.unload_layer(i)
            job.save_tensors(Job.layer_file(i), tensors)
            job.update(quantized_layers=i + 1)
            result.quantized_now.append(i)
            bar.set_postfix(max_err=f"{max(errors.values()):.4f}")
            bar.update()
            steps.done()
    if not job.get("head_done"):
        with _bar(o, total=1, desc="lm_head (rtn)", unit="linear") as bar:
            head, err = rtn_quantize_head(lm, job.settings["head_bits"], scale_search=search)
            bar.set_postfix(err=f"{err:.4f}")
            bar.update()
        job.save_tensors("head.safetensors", head)
        job.update(head_done=True)


def _measure(
    job: Job,
    lm: LayerwiseModel,
    mrows: torch.Tensor,
    o: ConvertOptions,
    search: str,
    steps: _Steps,
    result: ConvertResult,
) -> Measurement:
    n = lm.num_layers
    device = lm.device
    probing = o.sensitivity == "kl"
    score_tokens = _score_tokens(o, device)
    fit, scored = scoring_rows(
        int(mrows.shape[0]), int(mrows.shape[1]), heldout=o.heldout, score_tokens=score_tokens
    )
    record = job.get("measurement") or {
        "format": MEASUREMENT_FORMAT,
        "model": model_signature(lm),
        "calibration": {"rows": int(mrows.shape[0]), "length": int(mrows.shape[1])},
        # How candidates were scored, for the reader (nothing reads it back; files from
        # before this key lack it and were scored against the layer's output, in-sample).
        "scoring": {
            "error_reference": o.error_reference,
            "heldout": float(o.heldout),
            # Only when set: a file without it scored by the mean (token power 1).
            **({"token_power": float(o.token_power)} if o.token_power != 1 else {}),
            "hessian_rows": fit,
            "scored_rows": scored,
            "damp": float(o.damp),
            "shrink": _measure_shrink(o),
            **(_probe_scoring(lm, mrows, fast=o.fast) if probing else {}),
        },
        "layers": [],
    }
    done = len(record["layers"])
    if done == n and (not probing or "sensitivity" in record):
        return record
    runner = CalibrationRunner(lm, length=mrows.shape[1], chunk_rows=_chunk_rows(mrows, device))
    states = job.load_states("measure", done) if done else lm.embed(mrows).cpu()
    probe = probe_runner = None
    if probing:
        rows = record["scoring"]["sensitivity_rows"]
        tokens = record["scoring"]["sensitivity_tokens"]
        probe = (
            SensitivityProbe.from_tensors(job.load_state_extras("measure", done))
            if done
            else SensitivityProbe.start(states[:rows, :tokens])
        )
        probe_runner = CalibrationRunner(
            lm,
            length=tokens,
            chunk_rows=runner.chunk_rows * runner.length // tokens,
            rotary_length=runner.length,
        )
    references: dict[str, dict[str, torch.Tensor]] = {}
    keep = (REFERENCE_RUNG, references.__setitem__) if probe else None
    per_layer = gptq_runs(lm.layers[0])  # the bar counts GPTQ runs: rate and ETA
    with _bar(o, total=n * per_layer, initial=done * per_layer, desc="measure", unit="gptq") as bar:
        for i in range(done, n):
            bar.set_description(f"measure layer {i}")
            lm.load_layer(i)
            states, layer_record = measure_layer(
                runner,
                i,
                states,
                scale_search=search,
                damp=o.damp,
                shrink=_measure_shrink(o),
                score_tokens=score_tokens,
                error_reference=o.error_reference,
                heldout=o.heldout,
                token_power=o.token_power,
                tick=bar.update,
                keep=keep,
            )
            if probe and probe_runner:
                probe.advance(probe_runner, i, references)
                references.clear()
            lm.unload_layer(i)
            _check_finite(lm, i, states)
            record["layers"].append(layer_record)
            extra = probe.tensors() if probe else None
            job.advance_states("measure", i + 1, states, extra=extra, measurement=record)
            result.measured_now.append(i)
            steps.done()
    if probe:
        desc = f"sensitivity of {len(probe.branches)} modules"
        with _bar(o, total=probe.head_passes(), desc=desc, unit="block") as bar:
            costs = probe.costs(lm, bar.update)
        branches = zip(probe.branches, costs, strict=True)
        bad = [f"layer {i} {kind}" for (i, kind), c in branches if not math.isfinite(c)]
        if bad:
            raise ConvertError(
                f"the sensitivity probe's KL is not finite for {', '.join(bad[:4])} in "
                f"{lm.dtype} (the model's activations may leave its range); --sensitivity off "
                f"measures without it (the work so far stays in {job.path})"
            )
        record["sensitivity"] = sensitivity_record(record, probe, costs)
        job.update(measurement=record)
    return record


def _probe_scoring(lm: LayerwiseModel, mrows: torch.Tensor, *, fast: bool) -> dict[str, int]:
    rows, tokens = probe_shape(
        int(mrows.shape[0]),
        int(mrows.shape[1]),
        layers=lm.num_layers,
        hidden=lm.config.hidden_size,
        element_bytes=torch.tensor([], dtype=lm.dtype).element_size(),
        device_type=lm.device.type,
        fast=fast,
    )
    return {"sensitivity_rows": rows, "sensitivity_tokens": tokens}


def forward_dtype(model_dir: Path, device: torch.device) -> torch.dtype:
    """The dtype of the calibration forward: float16 on a GPU, float32 on the CPU (CPU half
    matmuls are slow) and for a model whose activations leave float16's range (Gemma:
    its residual stream reaches about 10^5), where bfloat16's 8-bit mantissa would blur
    the Hessians and the errors being measured."""
    if device.type == "cuda" and not overflows_float16(
        ModelConfig.from_dir(model_dir).architecture
    ):
        return torch.float16
    return torch.float32


def _check_finite(lm: LayerwiseModel, i: int, states: torch.Tensor) -> None:
    """Stop, naming the layer, where a layer's output holds inf or NaN: the next layer's
    Hessians would be NaN and its GPTQ fail with a message that hides the cause."""
    if not bool(torch.isfinite(states).all()):
        raise ConvertError(
            f"layer {i} of {lm.model_dir}: its output hidden states are not finite in "
            f"{str(lm.dtype).removeprefix('torch.')} (the activations leave the dtype's "
            "range); convert on the CPU (--device cpu, float32) or report the model"
        )


def _chunk_rows(rows: torch.Tensor, device: torch.device) -> int:
    tokens = 16384 if device.type == "cuda" else 2048
    return max(1, min(rows.shape[0], tokens // rows.shape[1]))
