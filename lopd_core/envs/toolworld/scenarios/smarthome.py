"""Scenario templates of the smart home environment (`envs/smarthome.py`): its random initial state and goals."""

from __future__ import annotations

import random
from typing import Any

from lopd_core.envs.toolworld.scenarios.common import Call, Goal, World, pick, ret

ROOMS = ["kitchen", "living room", "bedroom", "office", "garage", "hallway", "bathroom"]
LIGHT_NAMES = ["ceiling light", "desk lamp", "floor lamp", "wall light", "reading lamp", "strip light"]


def smarthome_world(rng: random.Random) -> dict[str, Any]:
    devices: dict[str, dict[str, Any]] = {}
    counters = {"light": 0, "thermostat": 0, "lock": 0, "speaker": 0}

    def add(kind: str, name: str, room: str, **state: Any) -> None:
        counters[kind] += 1
        devices[f"{kind}_{counters[kind]}"] = {"name": name, "room": room, "kind": kind, **state}

    for room in rng.sample(ROOMS, 4):
        for name in rng.sample(LIGHT_NAMES, rng.randint(1, 3)):
            on = rng.random() < 0.5
            add("light", name, room, on=on, brightness=rng.choice([20, 40, 60, 80, 100]) if on else 0)
        if rng.random() < 0.5:
            add("thermostat", "thermostat", room, on=True, target_celsius=rng.randint(16, 24))
        if rng.random() < 0.35:
            add("speaker", "speaker", room, on=rng.random() < 0.5, volume=rng.choice([10, 30, 50, 70]))
        if room in ("hallway", "garage") or rng.random() < 0.2:
            add("lock", "door lock", room, on=True, locked=rng.random() < 0.5)
    return {"devices": devices}


def _dev(world: World, kind: str | None = None, **state: Any) -> list[str]:
    return world.free(
        d
        for d, v in world.config["devices"].items()
        if (kind is None or v["kind"] == kind) and all(v.get(k) == x for k, x in state.items())
    )


def sh_turn_on(rng: random.Random, world: World) -> Goal | None:
    d = pick(rng, [d for d in _dev(world, on=False) if world.config["devices"][d]["kind"] != "lock"])
    if d is None:
        return None
    return Goal(
        f"Turn on {d}.",
        [("turn_on", {"device_id": d})],
        [(f"{d} is on", ret(f"final_state['devices'][{d!r}]['on'] is True"))],
        {d},
    )


def sh_turn_off(rng: random.Random, world: World) -> Goal | None:
    d = pick(rng, [d for d in _dev(world, on=True) if world.config["devices"][d]["kind"] in ("light", "speaker")])
    if d is None:
        return None
    return Goal(
        f"Turn off {d}.",
        [("turn_off", {"device_id": d})],
        [(f"{d} is off", ret(f"final_state['devices'][{d!r}]['on'] is False"))],
        {d},
    )


def sh_temperature(rng: random.Random, world: World) -> Goal | None:
    d = pick(rng, _dev(world, "thermostat"))
    if d is None:
        return None
    current = world.config["devices"][d]["target_celsius"]
    c = rng.choice([t for t in range(17, 26) if t != current])
    return Goal(
        f"Set {d} to {c} degrees.",
        [("set_temperature", {"device_id": d, "celsius": c})],
        [(f"{d} targets {c} C", ret(f"final_state['devices'][{d!r}]['target_celsius'] == {c}"))],
        {d},
    )


def sh_lock(rng: random.Random, world: World) -> Goal | None:
    d = pick(rng, _dev(world, "lock"))
    if d is None:
        return None
    locked = world.config["devices"][d]["locked"]
    verb, name = ("Unlock", "unlock") if locked else ("Lock", "lock")
    return Goal(
        f"{verb} {d}.",
        [(name, {"device_id": d})],
        [(f"{d} is {name}ed", ret(f"final_state['devices'][{d!r}]['locked'] is {not locked}"))],
        {d},
    )


def sh_volume(rng: random.Random, world: World) -> Goal | None:
    d = pick(rng, _dev(world, "speaker"))
    if d is None:
        return None
    v = rng.choice([v for v in (15, 25, 35, 45, 60, 80) if v != world.config["devices"][d]["volume"]])
    return Goal(
        f"Set the volume of {d} to {v}.",
        [("set_volume", {"device_id": d, "level": v})],
        [(f"{d} volume is {v}", ret(f"final_state['devices'][{d!r}]['volume'] == {v}"))],
        {d},
    )


def sh_brightness(rng: random.Random, world: World) -> Goal | None:
    """Depends on a rule: an off light must be turned on before its brightness changes (2 calls)."""
    d = pick(rng, _dev(world, "light"))
    if d is None:
        return None
    dev = world.config["devices"][d]
    b = rng.choice([b for b in (10, 30, 50, 70, 90) if b != dev["brightness"]])
    calls: list[Call] = [("set_brightness", {"device_id": d, "level": b})]
    if not dev["on"]:
        calls.insert(0, ("turn_on", {"device_id": d}))
    return Goal(
        f"Set the brightness of {d} to {b}.",
        calls,
        [(f"{d} brightness is {b}", ret(f"final_state['devices'][{d!r}]['brightness'] == {b}"))],
        {d},
    )


def sh_room_lights_off(rng: random.Random, world: World) -> Goal | None:
    devices = world.config["devices"]
    rooms = sorted({v["room"] for v in devices.values()})
    options = []
    for room in rooms:
        lights = [d for d, v in devices.items() if v["room"] == room and v["kind"] == "light"]
        on = [d for d in lights if devices[d]["on"]]
        if len(lights) >= 2 and on and f"room:{room}" not in world.used and not set(lights) & world.used:
            options.append((room, lights, on))
    if not options:
        return None
    room, lights, on = rng.choice(options)
    calls: list[Call] = [("list_devices", {"room": room})] + [("turn_off", {"device_id": d}) for d in on]
    check = ret(
        f"all(not v['on'] for v in final_state['devices'].values() if v['room'] == {room!r} and v['kind'] == 'light')"
    )
    return Goal(
        f"Turn off every light in the {room}.",
        calls,
        [(f"all {room} lights are off", check)],
        {f"room:{room}", *lights},
    )


def sh_by_name(rng: random.Random, world: World) -> Goal | None:
    devices = world.config["devices"]
    options = []
    for d in _dev(world, "light", on=False):
        room, name = devices[d]["room"], devices[d]["name"]
        if (
            sum(v["room"] == room and v["name"] == name for v in devices.values()) == 1
            and f"room:{room}" not in world.used
        ):
            options.append(d)
    d = pick(rng, options)
    if d is None:
        return None
    room, name = devices[d]["room"], devices[d]["name"]
    return Goal(
        f"Turn on the {name} in the {room}.",
        [("list_devices", {"room": room}), ("turn_on", {"device_id": d})],
        [(f"the {room} {name} is on", ret(f"final_state['devices'][{d!r}]['on'] is True"))],
        {d, f"room:{room}"},
    )


def sh_conditional(rng: random.Random, world: World) -> Goal | None:
    d = pick(rng, _dev(world, "thermostat"))
    if d is None:
        return None
    current = world.config["devices"][d]["target_celsius"]
    x = current + rng.choice([-2, -1, 1, 2])
    text = f"If {d} is set below {x} degrees, set it to {x} degrees; otherwise turn it off."
    if current < x:
        calls: list[Call] = [("get_device", {"device_id": d}), ("set_temperature", {"device_id": d, "celsius": x})]
        check = (
            f"{d} targets {x} C and is on",
            ret(
                f"final_state['devices'][{d!r}]['target_celsius'] == {x} and "
                f"final_state['devices'][{d!r}]['on'] is True"
            ),
        )
    else:
        calls = [("get_device", {"device_id": d}), ("turn_off", {"device_id": d})]
        check = (
            f"{d} is off and still targets {current} C",
            ret(
                f"final_state['devices'][{d!r}]['on'] is False and "
                f"final_state['devices'][{d!r}]['target_celsius'] == {current}"
            ),
        )
    return Goal(text, calls, [check], {d})


SMARTHOME = [
    sh_turn_on,
    sh_turn_off,
    sh_temperature,
    sh_lock,
    sh_volume,
    sh_brightness,
    sh_room_lights_off,
    sh_by_name,
    sh_conditional,
]
