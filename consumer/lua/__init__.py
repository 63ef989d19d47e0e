"""Every Redis script of dgr, one `.lua` file each, and the one way to read them.

A Redis script cannot include another, so a shared block (`lease.lua`, `deadletter.lua`) is its own
file and is prepended when a script that uses it is loaded: `SCRIPTS` names, once, what each script
is made of.
"""

from __future__ import annotations

from importlib import resources

__all__ = ["SCRIPTS", "load_lua", "script_source"]

# script -> the files it is made of, in order (shared blocks first).
SCRIPTS: dict[str, tuple[str, ...]] = {
    # complete.lua by concern, joined into ONE script (one EVALSHA per call, atomic as one): its header,
    # ARGV and call guard; the tally entries; the charges; publishing the rows; acks, closures and sums;
    # dead letters; the fused call's counters (docs/accounting.md: the control).
    "complete": ("lease", "complete", "complete_tally", "complete_charge", "complete_publish", "complete_close",
                 "complete_dead", "complete_call"),
    "pending": ("deadletter", "pending"),
    "recover": ("deadletter", "recover"),
    "acquire": ("acquire",),
    "renew": ("lease", "renew"),
    "release": ("release",),
    # ops (consumer/ops/*)
    "replay": ("replay",),
    "reap": ("reap",),
    "fold": ("fold",),
}


def load_lua(name: str) -> str:
    """The text of `consumer/lua/<name>.lua`."""
    return (resources.files(__package__) / f"{name}.lua").read_text(encoding="utf-8")


def script_source(name: str) -> str:
    """The source of script `name` as Redis gets it: its shared blocks, then its own file."""
    return "".join(load_lua(part) for part in SCRIPTS[name])
