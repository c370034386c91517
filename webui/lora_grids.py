"""Saved LoRA grids (the LoRA lab's results) under the user-data directory.

    user_data/lora_grids/<name>.json   loader.lora_grid's JSON: prompts, variants, settings,
                                       seed, every cell's text and numbers, perplexities
    user_data/lora_grids/<name>.md     the same grid as Markdown, for reading and sharing

Both files are written atomically (webui.storage); the JSON is what reopens.
"""

from __future__ import annotations

import time
from pathlib import Path

from loader.lora_grid import GridError, LoraGrid
from serving.storage import StorageError, atomic_write_text, read_json, safe_name, write_json


def default_name() -> str:
    return time.strftime("grid-%Y%m%d-%H%M%S")


class GridStore:
    def __init__(self, root: Path) -> None:
        self.dir = Path(root) / "lora_grids"

    def names(self) -> list[str]:
        """Saved grids, the most recent first."""
        if not self.dir.is_dir():
            return []
        files = [p for p in self.dir.glob("*.json") if not p.name.startswith(".")]
        files.sort(key=lambda p: p.stat().st_mtime, reverse=True)
        return [p.stem for p in files]

    def save(self, grid: LoraGrid, name: str) -> tuple[Path, Path]:
        """Write `grid` as `name`.json and `name`.md; returns both paths."""
        name = safe_name(name, "grid", new=True)
        grid.name = name
        json_path, md_path = self.dir / f"{name}.json", self.dir / f"{name}.md"
        write_json(json_path, grid.to_json())
        atomic_write_text(md_path, grid.to_markdown())
        return json_path, md_path

    def open(self, name: str) -> LoraGrid:
        """The grid saved as `name`; StorageError names the file and what is wrong."""
        path = self.dir / f"{safe_name(name, 'grid')}.json"
        data = read_json(path)
        try:
            return LoraGrid.from_json(data, source=str(path))
        except GridError as e:
            raise StorageError(str(e)) from None
