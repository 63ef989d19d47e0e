"""gateway/runner.py's Runner: the key a model's sessions use is chosen once per fleet read (choose_key passes over
every worker id ever registered: 4.8 ms at 5,100, per request before), again when the fleet is read again, and a
refusal (no worker up) is asked again at the next request."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from gateway import runner as R
from gateway.errors import ApiError


class FakeFleet:
    """AsyncProducer.fleet_now: the same list until the fleet is read again."""

    def __init__(self) -> None:
        self.reads: list[list[Any]] = [["a"], ["b"]]

    async def fleet_now(self) -> list[Any]:
        return self.reads[0]


def test_the_key_is_chosen_once_per_fleet_read(monkeypatch: pytest.MonkeyPatch) -> None:
    chosen: list[tuple[int, str]] = []
    up = [False]

    def choose(fleet: list[Any], model: Any) -> Any:
        chosen.append((id(fleet), model.name))
        if not up[0]:
            raise ApiError(503, "no worker is up")
        return ("placement", fleet[0], model.name)

    class Model:
        name = "m"

    monkeypatch.setattr(R, "choose_key", choose)
    fleet = FakeFleet()
    runner = R.Runner(fleet)  # type: ignore[arg-type]

    async def go() -> None:
        for _ in range(2):  # refused: asked again each time
            with pytest.raises(ApiError):
                await runner.place(Model())  # type: ignore[arg-type]
        up[0] = True
        first = [await runner.place(Model()) for _ in range(5)]  # type: ignore[arg-type]
        assert first == [("placement", "a", "m")] * 5
        fleet.reads.pop(0)  # the fleet read again (discover_cache_s later)
        assert await runner.place(Model()) == ("placement", "b", "m")  # type: ignore[arg-type]

    asyncio.run(go())
    assert len(chosen) == 4, chosen  # two refusals, one per fleet read
