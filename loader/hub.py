"""Models named by a Hugging Face id: downloaded once into the models directory.

    from loader.hub import resolve_model
    path = resolve_model("meta-llama/Llama-3.2-1B", Path("models"))
    path = resolve_model("turboderp/Llama-3.2-1B-Instruct-exl2:4.0bpw", Path("models"))

`ui.py --model`, `python -m loader MODEL` and `python -m extensions.openai --model` take a
local path, a name in the models directory, or a Hugging Face id `owner/name`, optionally
with a branch, tag or commit after a colon (as text-generation-webui's download-model.py
writes it; EXL2 repositories keep one bit width per branch) or an `@`.

A Hub id that is not on disk yet is fetched with huggingface_hub into its usual cache
(`HF_HUB_CACHE`, by default ~/.cache/huggingface/hub) with its progress bars; an interrupted
download resumes from its partial files on the next run. The snapshot is then linked (hard
links, so no second copy on the same file system; copied otherwise) into
`<models dir>/<owner>_<name>[_<branch>]`, written under a temporary name and renamed, so
the models directory never holds half a model and the Model tab lists it like any other.
Only what Kestrel reads is fetched: config, tokenizer and safetensors files (no pickled
`.bin` checkpoints, which Kestrel never loads, nor `.gguf` files).

Offline (HF_HUB_OFFLINE=1, or no network) the cache is used when it holds the snapshot;
otherwise the error says that it is offline and where it looked. Nothing here loads a model.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
from pathlib import Path

from loader.base import LoaderError

# What Kestrel reads from a model repository.
ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.tiktoken", "*.jinja", "*.txt"]
# owner/name as the Hub allows them, then an optional :revision or @revision.
_HUB_ID = re.compile(
    r"^(?P<repo>[A-Za-z0-9][A-Za-z0-9._-]{0,95}/[A-Za-z0-9][A-Za-z0-9._-]{0,95})"
    r"(?:[:@](?P<revision>[A-Za-z0-9][A-Za-z0-9._/-]{0,199}))?$"
)


class ModelSourceError(LoaderError):
    """A model argument that is neither on disk nor to be had from the Hub."""


def parse_hub_id(text: str) -> tuple[str, str | None] | None:
    """(repo_id, revision or None) if `text` has the shape of a Hub id, else None."""
    match = _HUB_ID.match(text)
    if match is None or ".." in text or text.endswith((".gguf", ".safetensors")):
        return None
    return match["repo"], match["revision"]


def local_dirname(repo_id: str, revision: str | None) -> str:
    """The directory a Hub model gets in the models directory: owner_name[_revision]."""
    name = repo_id.replace("/", "_")
    if revision and revision != "main":
        name += "_" + revision.replace("/", "_")
    return name


def resolve_model(model: str, models_dir: Path, *, progress: bool = True) -> Path:
    """The model directory (or .gguf file) that `model` names, fetching a Hub id first.

    Order: an entry of `models_dir` named `model`; an existing path; a Hub id (its
    directory in `models_dir` if already there, else downloaded). Raises ModelSourceError
    with one clear line otherwise."""
    models_dir = Path(models_dir)
    if Path(model).name == model and model not in (".", "..") and (models_dir / model).exists():
        return models_dir / model
    path = Path(model).expanduser()
    if path.exists():
        return path
    hub = parse_hub_id(model)
    if hub is None:
        raise ModelSourceError(
            f"{model!r} is neither a model in {models_dir} nor an existing path (nor a "
            "Hugging Face id like owner/name)"
        )
    repo_id, revision = hub
    target = models_dir / local_dirname(repo_id, revision)
    if target.exists():
        return target
    snapshot = download_snapshot(repo_id, revision, progress=progress)
    _check_loadable(snapshot, repo_id)
    _place(snapshot, target)
    if progress:
        _say(f"{repo_id} is in {target}")
    return target


def download_snapshot(repo_id: str, revision: str | None, *, progress: bool = True) -> Path:
    """The Hub snapshot of repo_id@revision in the Hugging Face cache, downloaded (or
    resumed) when missing. Raises ModelSourceError naming the cause."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HFValidationError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    where = f"{repo_id}" + (f" (revision {revision})" if revision else "")
    if progress and not constants.HF_HUB_OFFLINE:
        _say(f"fetching {where} from Hugging Face into {constants.HF_HUB_CACHE}")
    try:
        folder = snapshot_download(repo_id, revision=revision, allow_patterns=ALLOW_PATTERNS)
    except GatedRepoError:
        raise ModelSourceError(
            f"{repo_id} is gated: accept its terms on huggingface.co and log in "
            "(`.venv/bin/hf auth login` or HF_TOKEN), then try again"
        ) from None
    except RevisionNotFoundError:
        raise ModelSourceError(
            f"{repo_id} has no branch, tag or commit {revision!r} (see its 'Files and versions')"
        ) from None
    except RepositoryNotFoundError:
        raise ModelSourceError(
            f"no model {repo_id} on Hugging Face (or it is private: log in with HF_TOKEN)"
        ) from None
    except HFValidationError as e:
        raise ModelSourceError(f"{repo_id!r} is not a valid Hugging Face id: {e}") from None
    except LocalEntryNotFoundError as e:
        if type(e).__name__ == "IncompleteSnapshotError":  # a download cut short, now offline
            raise ModelSourceError(f"cannot finish downloading {where}: {_first_line(e)}") from None
        cache = constants.HF_HUB_CACHE
        if constants.HF_HUB_OFFLINE:
            why = "offline (HF_HUB_OFFLINE is set)"
        else:
            why = f"Hugging Face could not be reached ({_first_line(e)})"
        raise ModelSourceError(
            f"cannot download {where}: {why}, and it is not in the Hugging Face cache "
            f"({cache}). Download it where there is network (this same command), or copy "
            "its folder into the models directory"
        ) from None
    except OSError as e:  # disk full, permissions in the cache
        raise ModelSourceError(f"downloading {where} failed: {e}") from None
    return Path(folder)


def _check_loadable(snapshot: Path, repo_id: str) -> None:
    if not (snapshot / "config.json").is_file():
        raise ModelSourceError(
            f"{repo_id} has no config.json: Kestrel loads Hugging Face model repositories "
            "(FP16/BF16, EXL2 or GPTQ safetensors). For a GGUF repository, download the "
            ".gguf file into the models directory"
        )
    if not any(snapshot.glob("*.safetensors")):
        raise ModelSourceError(
            f"{repo_id} has no .safetensors weights (pickled .bin checkpoints are not loaded)"
        )


def _place(snapshot: Path, target: Path) -> None:
    """Hard-link (else copy) the snapshot's files into `target`, atomically."""
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.parent / f".{target.name}.partial-{os.getpid()}"
    shutil.rmtree(partial, ignore_errors=True)
    copied = False
    try:
        for source in sorted(snapshot.rglob("*")):
            if source.is_dir():
                continue
            dest = partial / source.relative_to(snapshot)
            dest.parent.mkdir(parents=True, exist_ok=True)
            real = source.resolve()  # the cache's snapshot files are links to its blobs
            try:
                os.link(real, dest)
            except OSError:
                shutil.copyfile(real, dest)
                copied = True
        os.replace(partial, target)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    if copied:
        _say(f"copied into {target} (the Hugging Face cache is on another file system)")


def _first_line(error: BaseException) -> str:
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__


def _say(message: str) -> None:
    print(f"[kestrel] {message}", file=sys.stderr, flush=True)
