"""Build the shipped calibration text and the held-out evaluation text from their sources.

    python tools/build_quality_text.py --sources DIR --wiki wiki.utf8

DIR holds git checkouts named owner+name (the commits in engine/quantizer/data/README.md
and tools/heldout/README.md); --wiki is the Wikipedia text of exllamav2's standard
calibration set, whose first 145 articles are engine/quantizer/data/wiki.utf8 already.
Each source is split once, so no text reaches both sides:

- multilingual: Parallel Universal Dependencies (PUD) sentences. The 1000 sentences are the
  same ones in every language, so the split is by sentence: the first half (in every
  language) calibrates, the second half (in every language) evaluates.
- code: whole source files; calibration from requests (Python) and express (JavaScript),
  evaluation from flask (Python) and ripgrep (Rust): different projects on each side.
- chat: human-written instruction/answer pairs of self-instruct, rendered as ChatML
  turns; calibration from its 175 seed tasks, evaluation from its 252 user-oriented tasks.
- web: UD English Web Treebank (blogs, newsgroups, e-mail, reviews, answers); calibration
  from its dev part, evaluation from its test part.
- wiki: evaluation from the last 20% of --wiki (calibration uses its first 8%).

The script is the record of how the files were made; it is not needed at run time.
"""

from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CAL_DIR = ROOT / "engine" / "quantizer" / "data"
EVAL_DIR = ROOT / "tools" / "heldout"

PUD_LANGUAGES = ("de", "fr", "es", "it", "pt", "pl", "ru", "zh", "ar")
PUD_NAMES = {"de": "German", "fr": "French", "es": "Spanish", "it": "Italian",
             "pt": "Portuguese", "pl": "Polish", "ru": "Russian", "zh": "Chinese",
             "ar": "Arabic"}  # fmt: skip
CAL_CODE = {"psf+requests": ("src/requests/", ".py"), "expressjs+express": ("lib/", ".js")}
EVAL_CODE = {
    "pallets+flask": ("src/flask/", ".py"),
    "BurntSushi+ripgrep": ("crates/globset/src/", ".rs"),
}


def _git_show(repo: Path, path: str) -> str:
    return subprocess.run(
        ["git", "-C", str(repo), "show", f"HEAD:{path}"], capture_output=True, check=True
    ).stdout.decode("utf-8")


def _git_files(repo: Path, prefix: str, suffix: str) -> list[str]:
    out = subprocess.run(
        ["git", "-C", str(repo), "ls-tree", "-r", "--name-only", "HEAD", prefix],
        capture_output=True, check=True, text=True,
    ).stdout  # fmt: skip
    return sorted(p for p in out.splitlines() if p.endswith(suffix))


def _repo(sources: Path, name: str) -> Path:
    path = sources / name / "repo"
    return path if path.is_dir() else sources / name


def conllu_documents(text: str) -> list[list[str]]:
    """Sentences ("# text = ...") grouped by "# newdoc" markers."""
    docs: list[list[str]] = [[]]
    for line in text.splitlines():
        if line.startswith("# newdoc") and docs[-1]:
            docs.append([])
        elif line.startswith("# text = "):
            docs[-1].append(line[len("# text = ") :].strip())
    return [d for d in docs if d]


def _pud(sources: Path) -> tuple[str, str]:
    cal: list[list[str]] = []
    held: list[list[str]] = []
    for lang in PUD_LANGUAGES:
        repo = _repo(sources, f"UniversalDependencies+UD_{PUD_NAMES[lang]}-PUD")
        sentences = [s for d in conllu_documents(_git_show(repo, f"{lang}_pud-ud-test.conllu"))
                     for s in d]  # fmt: skip
        if len(sentences) != 1000:
            raise SystemExit(f"{lang} PUD has {len(sentences)} sentences, not 1000")
        sep = "" if lang == "zh" else " "
        # Paragraphs of 10 sentences: readable text without pretending to be documents.
        for part, out in ((sentences[:500], cal), (sentences[500:], held)):
            out.append([sep.join(part[i : i + 10]) for i in range(0, len(part), 10)])
    # Languages take turns paragraph by paragraph, so any prefix (the first calibration
    # rows, the first evaluation windows) holds all of them.
    return _take_turns(cal), _take_turns(held)


def _take_turns(parts: list[list[str]]) -> str:
    return "\n\n".join(p[i] for i in range(max(map(len, parts))) for p in parts if i < len(p))


def _code(sources: Path, which: dict[str, tuple[str, str]]) -> str:
    parts = []
    for name, (prefix, suffix) in which.items():
        repo = _repo(sources, name)
        files = []
        for path in _git_files(repo, prefix, suffix):
            body = _git_show(repo, path)
            if body.strip():
                files.append(f"// {name.replace('+', '/')}: {path}\n{body}")
        parts.append(files)
    return _take_turns(parts)  # the projects' files alternate


def _cut(text: str, chars: int) -> str:
    """The text's first `chars` characters, ended at a paragraph break."""
    if len(text) <= chars:
        return text
    end = text.rfind("\n\n", 0, chars)
    return text[: end if end > 0 else chars].rstrip() + "\n"


def chatml(instruction: str, given: str, answer: str) -> str:
    user = instruction.strip() + (f"\n\n{given.strip()}" if given.strip() else "")
    return (
        f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n{answer.strip()}<|im_end|>\n"
    )


def _chat(sources: Path, path: str) -> str:
    repo = _repo(sources, "yizhongw+self-instruct")
    turns = []
    for line in _git_show(repo, path).splitlines():
        if not line.strip():
            continue
        task = json.loads(line)
        for inst in task["instances"]:
            turns.append(chatml(task["instruction"], inst.get("input", ""), inst["output"]))
    return "".join(turns)


def _ewt(sources: Path, split: str) -> str:
    repo = _repo(sources, "UniversalDependencies+UD_English-EWT")
    docs = conllu_documents(_git_show(repo, f"en_ewt-ud-{split}.conllu"))
    return "\n\n".join(" ".join(d) for d in docs) + "\n"


def _wiki_tail(path: Path) -> str:
    text = path.read_text(encoding="utf-8")
    tail = text[int(len(text) * 0.8) :]
    # Whole articles only: start after the first article end in the tail.
    return tail[tail.index("</doc>") + len("</doc>") :].lstrip()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sources", required=True, type=Path)
    p.add_argument("--wiki", required=True, type=Path)
    a = p.parse_args()
    EVAL_DIR.mkdir(exist_ok=True)
    pud_cal, pud_eval = _pud(a.sources)
    # Sizes: calibration about 20-80k tokens a source (SmolLM2's tokenizer); evaluation
    # at least 30 windows of 1024 tokens for SmolLM2 and 20 for Gemma 3's larger vocabulary.
    files = {
        CAL_DIR / "multilingual.utf8": _cut(pud_cal, 160_000),
        EVAL_DIR / "multilingual.utf8": _cut(pud_eval, 160_000),
        CAL_DIR / "code.utf8": _cut(_code(a.sources, CAL_CODE), 200_000),
        EVAL_DIR / "code.utf8": _cut(_code(a.sources, EVAL_CODE), 200_000),
        CAL_DIR / "chat.utf8": _chat(a.sources, "data/seed_tasks.jsonl"),
        EVAL_DIR / "chat.utf8": _chat(a.sources, "human_eval/user_oriented_instructions.jsonl"),
        CAL_DIR / "web.utf8": _ewt(a.sources, "dev"),
        EVAL_DIR / "web.utf8": _ewt(a.sources, "test"),
        EVAL_DIR / "wiki.utf8": _cut(_wiki_tail(a.wiki), 200_000),
    }
    for path, text in files.items():
        path.write_text(text, encoding="utf-8")
        print(f"{path.relative_to(ROOT)}: {len(text.encode()) // 1024} KB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
