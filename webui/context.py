"""What every tab of one running UI shares: the model manager, the user-data folders, the
generation running in each browser session (so Stop in one tab never stops another user's
reply, and a page never starts a second reply over the first), and the record of applied
LoRAs.
"""

from __future__ import annotations

import argparse
import itertools
import threading
from dataclasses import dataclass, field

from loader.manager import ModelManager
from serving import shared
from serving.sessions import UserData
from webui.presets import Presets


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
class Job:
    """One generation of one browser session (a chat reply or a notebook completion).

    `stop` ends it early. `detached` means the page has moved on (New chat, cleared chat):
    the job still finishes and saves to its own chat, but sends the page nothing that
    changes it. `quiet` is set once every update of the page it will send is on its way
    (ahead of whatever the page is sent next), so a New chat's empty page is never followed
    by an update of the old conversation (webui.chat_tab's `to_page`)."""

    id: int
    session: str
    stop: threading.Event = field(default_factory=threading.Event)
    detached: threading.Event = field(default_factory=threading.Event)
    quiet: threading.Event = field(default_factory=threading.Event)
    # A chat reply's chat name as the page shows it now: a rename typed while the reply is
    # written reaches the job (AppContext.rename_chat), which saves under it at its end.
    chat_name: str | None = None
    _name_lock: threading.Lock = field(default_factory=threading.Lock)

    def name_chat(self, name: str) -> None:
        """The name the page showed when the reply was asked for, unless a rename typed
        since has already arrived (an event's inputs are read before it waits in the
        queue, so they may be older than a rename handled meanwhile)."""
        with self._name_lock:
            if self.chat_name is None:
                self.chat_name = name

    def rename(self, name: str) -> None:
        with self._name_lock:
            self.chat_name = name

    def may_update_page(self) -> bool:
        """False once detached; afterwards `quiet` is set (checked right before a yield)."""
        if self.detached.is_set():
            self.quiet.set()
            return False
        return True


# How long New chat waits for a detached reply to go quiet (it goes quiet at its next token;
# this bound only keeps a wedged model from hanging the button).
DETACH_WAIT_S = 30.0


@dataclass
class AppContext:
    manager: ModelManager
    user_data: UserData
    args: argparse.Namespace = field(default_factory=argparse.Namespace)
    loras: LoraRecord = field(default_factory=LoraRecord)
    _running: dict[str, Job] = field(default_factory=dict)
    _ended: dict[str, int] = field(default_factory=dict)  # jobs ended, per session
    _jobs_lock: threading.Lock = field(default_factory=threading.Lock)
    _ids: itertools.count = field(default_factory=lambda: itertools.count(1))

    @property
    def presets(self) -> Presets:
        return Presets(self.user_data.presets_dir)

    def start_job(self, session: str) -> Job | None:
        """A new job for this session, or None while one is already running there. A reply
        that starts clears TGW's stop_everything, as TGW's own generation does."""
        with self._jobs_lock:
            if session in self._running:
                return None
            job = Job(next(self._ids), session)
            self._running[session] = job
        shared.stop_everything = False
        return job

    def job(self, session: str, job_id: int | None) -> Job | None:
        """The session's running job if its id is `job_id`."""
        with self._jobs_lock:
            job = self._running.get(session)
        return job if job is not None and job.id == job_id else None

    def end_job(self, job: Job) -> None:
        job.quiet.set()
        with self._jobs_lock:
            if self._running.get(job.session) is job:
                del self._running[job.session]
            self._ended[job.session] = self._ended.get(job.session, 0) + 1

    def ended_jobs(self, session: str) -> int:
        """How many jobs of this session have ended: a page that has seen fewer sends
        events that predate the latest job's end (a stream's late updates)."""
        with self._jobs_lock:
            return self._ended.get(session, 0)

    def forget_session(self, page: str) -> None:
        """Drop what is kept per session for a browser page (its session hash) that has
        closed. Its running jobs, if any, go on and end as usual."""
        prefix = f"{page}/"
        with self._jobs_lock:
            for session in [s for s in self._ended if s.startswith(prefix)]:
                del self._ended[session]

    def rename_chat(self, session: str, name: str) -> None:
        """The user typed `name` in the chat-name box: the session's running reply saves
        under it. A detached reply keeps the name it had (the page shows another chat)."""
        with self._jobs_lock:
            job = self._running.get(session)
        if job is not None:
            job.rename(name)

    def is_running(self, session: str) -> bool:
        with self._jobs_lock:
            return session in self._running

    def stop(self, session: str) -> bool:
        """Ask this session's generation to stop; False when none is running."""
        with self._jobs_lock:
            job = self._running.get(session)
        if job is None:
            return False
        job.stop.set()
        return True

    def stop_all(self) -> None:
        """Stop every reply of this UI (TGW's stop_everything). The UI's replies only: the
        API's requests share the model but each has a stop of its own."""
        with self._jobs_lock:
            jobs = list(self._running.values())
        for job in jobs:
            job.stop.set()

    def detach(self, session: str) -> None:
        """Stop the session's job and cut it off from the page (it still saves its own
        chat); returns once it sends the page nothing more. The session may start a new
        job at once."""
        with self._jobs_lock:
            job = self._running.pop(session, None)
        if job is None:
            return
        job.detached.set()
        job.stop.set()
        job.quiet.wait(DETACH_WAIT_S)
