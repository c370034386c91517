"""What every tab of one running UI shares: the model manager, the user-data folders, and
one stop switch per browser session (so Stop in one tab never stops another user's reply),
and the record of applied LoRAs.
"""

from __future__ import annotations

import argparse
import threading
from dataclasses import dataclass, field

from loader.manager import ModelManager
from webui.presets import Presets
from webui.sessions import UserData


@dataclass
class LoraRecord:
    """Which LoRAs the UI applied to which model, and their scales (shown in the panel)."""

    model_id: int = 0
    scales: dict[str, float] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def for_model(self, model: object) -> dict[str, float]:
        """The record for `model`, emptied when a different model was loaded since."""
        if id(model) != self.model_id:
            self.model_id, self.scales = id(model), {}
        return self.scales


@dataclass
class AppContext:
    manager: ModelManager
    user_data: UserData
    args: argparse.Namespace = field(default_factory=argparse.Namespace)
    loras: LoraRecord = field(default_factory=LoraRecord)
    _stops: dict[str, threading.Event] = field(default_factory=dict)
    _stops_lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def presets(self) -> Presets:
        return Presets(self.user_data.presets_dir)

    def new_stop(self, session: str) -> threading.Event:
        """A fresh stop switch for the generation this session starts now."""
        event = threading.Event()
        with self._stops_lock:
            self._stops[session] = event
        return event

    def stop(self, session: str) -> bool:
        """Ask this session's generation to stop; False when none was started."""
        with self._stops_lock:
            event = self._stops.get(session)
        if event is None:
            return False
        event.set()
        return True
