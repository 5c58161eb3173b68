"""The mailbox a rank writes its ring copies into and its successor maps: what the successor reads is a
whole entry or none, the memory of entries no longer kept is written over, and a writer stopped in the
middle of an entry leaves the older ones readable."""

from __future__ import annotations

import pytest
import torch

from torchpass_plugins.core import mailbox as mailbox_module
from torchpass_plugins.core.mailbox import SLOTS, Mailbox, PredecessorMailbox


def _entry(step: int, n: int = 10_000) -> dict:
    return {"own": {"seen": torch.tensor([step])}, "grads": torch.full((n,), step + 0.5), "step": step}


def _pair() -> tuple[Mailbox, PredecessorMailbox]:
    writer = Mailbox()
    return writer, PredecessorMailbox(writer.id, writer.segment.nbytes)


def test_the_successor_reads_the_kept_entries_and_their_memory_is_reused():
    writer, reader = _pair()
    for step in range(20):
        writer.put("vote", step, _entry(step), keep=set(writer.steps("vote")[-2:]))
        writer.put("boundary", step, {"b": step}, keep=set())
        if step == 3:
            extent = writer.extent
    assert reader.steps("vote") == {17, 18, 19} and reader.steps("boundary") == {19}
    got = reader.get("vote", 18)
    assert got["step"] == 18 and torch.equal(got["grads"], torch.full((10_000,), 18.5))
    assert reader.get("vote", 16) is None  # not kept: its memory was written over
    assert writer.extent == extent  # steady state: new entries take the memory of dropped ones


def test_an_entry_written_again_for_the_same_step_replaces_it():
    writer, reader = _pair()
    writer.put("vote", 5, _entry(5), keep=set())
    writer.put("vote", 5, {**_entry(5), "step": "retried"}, keep={5})
    assert reader.steps("vote") == {5} and reader.get("vote", 5)["step"] == "retried"


def test_a_writer_stopped_in_the_middle_of_an_entry_leaves_none_of_it(monkeypatch):
    writer, reader = _pair()
    writer.put("vote", 1, _entry(1), keep=set())
    plan = mailbox_module.pack_plan

    def torn(state):  # the copy fails after the first tensor: as a writer killed mid-entry
        meta, size, sources = plan(state)
        return meta, size, [sources[0], (sources[1][0], object())]

    monkeypatch.setattr(mailbox_module, "pack_plan", torn)
    with pytest.raises(AttributeError):
        writer.put("vote", 2, _entry(2), keep={1})
    assert reader.steps("vote") == {1} and reader.get("vote", 2) is None
    assert reader.get("vote", 1)["step"] == 1


def test_a_reader_that_finds_its_entry_rewritten_while_copying_it_gets_none(monkeypatch):
    writer, reader = _pair()
    writer.put("vote", 1, _entry(1), keep=set())
    copy_out = mailbox_module.unpack

    def meanwhile(meta, payload):  # the writer drops the entry while the reader copies it
        state = copy_out(meta, payload)
        writer.forget()
        return state

    monkeypatch.setattr(mailbox_module, "unpack", meanwhile)
    assert reader.get("vote", 1) is None


def test_forget_leaves_no_entry():
    writer, reader = _pair()
    writer.put("boundary", 1, {"b": 1}, keep=set())
    writer.forget()
    assert reader.steps("boundary") == set() and reader.get("boundary", 1) is None


def test_more_entries_than_slots_is_a_clear_error():
    writer, _ = _pair()
    for step in range(SLOTS):
        writer.put("vote", step, {"s": step}, keep=set(range(step)))
    with pytest.raises(RuntimeError, match="lower replicate_every_n_steps"):
        writer.put("vote", SLOTS, {"s": SLOTS}, keep=set(range(SLOTS)))
