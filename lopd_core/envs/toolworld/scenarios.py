"""Scenario templates of the toolworld suite: random initial states and goals with reference calls and checks.

A *goal* is one thing the user asks for: an instruction sentence, the reference calls that achieve it (a call
may depend on what earlier calls returned or created, so calls can be functions of the live environment) and
check functions over the initial and final state, in EnvScaler's form (`def check_func(final_state)` reading
the global `initial_state`). A scenario joins one to three goals on disjoint entities; its difficulty is the
number of reference calls. `generate.py` builds, verifies and writes scenarios.

Ids are realistic but explicit; instructions name what the user would name (an id, a person, a title) and
never the tool to call or a value the agent has to look up.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

Call = tuple[str, dict[str, Any]] | Callable[[Any], tuple[str, dict[str, Any]]]

PEOPLE = [
    "Maria Lopez",
    "James Chen",
    "Aisha Khan",
    "Tom Becker",
    "Sofia Rossi",
    "Noah Smith",
    "Emma Dubois",
    "Yuki Tanaka",
    "Omar Haddad",
    "Lena Novak",
    "Carlos Silva",
    "Priya Patel",
    "Ben Walker",
    "Hana Kim",
    "Ivan Petrov",
    "Grace Obi",
    "Lucas Moreau",
    "Zara Ahmed",
    "Felix Wagner",
    "Nina Berg",
]


@dataclass
class Goal:
    text: str
    calls: list[Call]
    checks: list[tuple[str, str]]  # (check item, body of check_func returning a bool)
    touches: set[str] = field(default_factory=set)

    @property
    def size(self) -> int:
        return len(self.calls)


class World:
    """An initial state under construction plus the entities goals have claimed."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config
        self.used: set[str] = set()

    def free(self, keys: Any) -> list[Any]:
        return [k for k in keys if k not in self.used]


def ret(expr: str) -> str:
    return f"return {expr}"


def close(a: str, b: str) -> str:
    return f"abs(({a}) - ({b})) < 0.005"


def pick(rng: random.Random, items: list[Any]) -> Any:
    return rng.choice(items) if items else None


def last_created(key: str, id_field: str) -> Callable[[Any], str]:
    """The id of the newest entry of a dict attribute whose ids look like PREFIX-<n>."""

    def get(env: Any) -> str:
        table = getattr(env, key)
        return max(table, key=lambda k: int(k.rsplit("-", 1)[1]))

    return get


# ------------------------------------------------------------------------------------------- smart home

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


# ------------------------------------------------------------------------------------------------- bank

PAYEES = ["PowerCo", "AquaWorks", "NetStream", "CityGas", "PhoneMax", "HomeInsure"]


def bank_world(rng: random.Random) -> dict[str, Any]:
    accounts: dict[str, dict[str, Any]] = {}
    numbers = rng.sample(range(1000, 9999), 10)
    for owner in rng.sample(PEOPLE, 4):
        for kind in rng.sample(["checking", "savings"], rng.randint(1, 2)):
            accounts[f"ACC-{numbers.pop()}"] = {
                "owner": owner,
                "kind": kind,
                "balance": float(rng.randrange(200, 5000, 10)),
                "frozen": rng.random() < 0.1,
            }
    bills = {}
    for payee in rng.sample(PAYEES, 4):
        bills[f"BILL-{rng.randint(1, 99)}"] = {
            "payee": payee,
            "amount": float(rng.randrange(20, 300, 5)),
            "paid": rng.random() < 0.2,
            "paid_from": None,
        }
    return {"accounts": accounts, "bills": bills, "transactions": []}


def _acc(world: World, **state: Any) -> list[str]:
    return world.free(a for a, v in world.config["accounts"].items() if all(v.get(k) == x for k, x in state.items()))


def _balance_checks(a: str, delta: float) -> tuple[str, str]:
    sign = "-" if delta < 0 else "+"
    return (
        f"{a} balance changed by {sign}{abs(delta):g}",
        ret(
            close(
                f"final_state['accounts'][{a!r}]['balance']", f"initial_state['accounts'][{a!r}]['balance'] + ({delta})"
            )
        ),
    )


def bank_transfer(rng: random.Random, world: World) -> Goal | None:
    free = _acc(world, frozen=False)
    if len(free) < 2:
        return None
    a, b = rng.sample(free, 2)
    amount = rng.randrange(10, int(min(world.config["accounts"][a]["balance"], 600)), 5)
    return Goal(
        f"Transfer {amount:g} dollars from account {a} to account {b}.",
        [("transfer", {"from_account_id": a, "to_account_id": b, "amount": amount})],
        [_balance_checks(a, -amount), _balance_checks(b, amount)],
        {a, b},
    )


def bank_freeze(rng: random.Random, world: World) -> Goal | None:
    a = pick(rng, _acc(world))
    if a is None:
        return None
    frozen = world.config["accounts"][a]["frozen"]
    verb, tool, state = (
        ("Unfreeze", "unfreeze_account", "unfrozen") if frozen else ("Freeze", "freeze_account", "frozen")
    )
    return Goal(
        f"{verb} account {a}.",
        [(tool, {"account_id": a})],
        [(f"{a} is {state}", ret(f"final_state['accounts'][{a!r}]['frozen'] is {not frozen}"))],
        {a},
    )


def _unpaid(world: World) -> list[str]:
    return world.free(b for b, v in world.config["bills"].items() if not v["paid"])


def _bill_checks(bill: str, a: str, amount: float) -> list[tuple[str, str]]:
    return [
        (
            f"{bill} is paid from {a}",
            ret(
                f"final_state['bills'][{bill!r}]['paid'] is True and "
                f"final_state['bills'][{bill!r}]['paid_from'] == {a!r}"
            ),
        ),
        _balance_checks(a, -amount),
    ]


def bank_pay(rng: random.Random, world: World) -> Goal | None:
    bill = pick(rng, _unpaid(world))
    if bill is None:
        return None
    amount = world.config["bills"][bill]["amount"]
    a = pick(rng, [a for a in _acc(world, frozen=False) if world.config["accounts"][a]["balance"] >= amount])
    if a is None:
        return None
    return Goal(
        f"Pay bill {bill} from account {a}.",
        [("pay_bill", {"bill_id": bill, "account_id": a})],
        _bill_checks(bill, a, amount),
        {bill, a},
    )


def _owner_kind_options(world: World) -> list[tuple[str, str, str]]:
    accounts = world.config["accounts"]
    out = []
    for a in _acc(world, frozen=False):
        owner, kind = accounts[a]["owner"], accounts[a]["kind"]
        if (
            sum(v["owner"] == owner and v["kind"] == kind for v in accounts.values()) == 1
            and f"owner:{owner}" not in world.used
        ):
            out.append((a, owner, kind))
    return out


def bank_transfer_owner(rng: random.Random, world: World) -> Goal | None:
    options = _owner_kind_options(world)
    if not options:
        return None
    a, owner, kind = rng.choice(options)
    b = pick(rng, [b for b in _acc(world, frozen=False) if world.config["accounts"][b]["owner"] != owner])
    if b is None:
        return None
    amount = rng.randrange(10, int(min(world.config["accounts"][a]["balance"], 500)), 5)
    return Goal(
        f"Transfer {amount:g} dollars from {owner}'s {kind} account to account {b}.",
        [
            ("list_accounts", {"owner": owner}),
            ("transfer", {"from_account_id": a, "to_account_id": b, "amount": amount}),
        ],
        [_balance_checks(a, -amount), _balance_checks(b, amount)],
        {a, b, f"owner:{owner}"},
    )


def _payee_bills(world: World) -> list[str]:
    bills = world.config["bills"]
    return [b for b in _unpaid(world) if sum(v["payee"] == bills[b]["payee"] for v in bills.values()) == 1]


def bank_pay_payee(rng: random.Random, world: World) -> Goal | None:
    bill = pick(rng, _payee_bills(world))
    if bill is None:
        return None
    payee, amount = world.config["bills"][bill]["payee"], world.config["bills"][bill]["amount"]
    a = pick(rng, [a for a in _acc(world, frozen=False) if world.config["accounts"][a]["balance"] >= amount])
    if a is None:
        return None
    return Goal(
        f"Pay the {payee} bill from account {a}.",
        [("list_bills", {"payee": payee}), ("pay_bill", {"bill_id": bill, "account_id": a})],
        _bill_checks(bill, a, amount),
        {bill, a},
    )


def bank_pay_payee_owner(rng: random.Random, world: World) -> Goal | None:
    bill = pick(rng, _payee_bills(world))
    if bill is None:
        return None
    payee, amount = world.config["bills"][bill]["payee"], world.config["bills"][bill]["amount"]
    options = [o for o in _owner_kind_options(world) if world.config["accounts"][o[0]]["balance"] >= amount]
    if not options:
        return None
    a, owner, kind = rng.choice(options)
    return Goal(
        f"Pay the {payee} bill from {owner}'s {kind} account.",
        [
            ("list_bills", {"payee": payee}),
            ("list_accounts", {"owner": owner}),
            ("pay_bill", {"bill_id": bill, "account_id": a}),
        ],
        _bill_checks(bill, a, amount),
        {bill, a, f"owner:{owner}"},
    )


def bank_conditional(rng: random.Random, world: World) -> Goal | None:
    free = _acc(world, frozen=False)
    if len(free) < 2:
        return None
    a, b = rng.sample(free, 2)
    balance = world.config["accounts"][a]["balance"]
    threshold = int(max(50, balance + rng.choice([-300, -100, 100, 300])))
    amount = rng.randrange(10, int(min(balance, 300)) + 1, 5)
    text = (
        f"If account {a} holds more than {threshold:g} dollars, transfer {amount:g} dollars from it to "
        f"account {b}; otherwise freeze account {a}."
    )
    if balance > threshold:
        calls: list[Call] = [
            ("get_balance", {"account_id": a}),
            ("transfer", {"from_account_id": a, "to_account_id": b, "amount": amount}),
        ]
        checks = [_balance_checks(a, -amount), _balance_checks(b, amount)]
    else:
        calls = [("get_balance", {"account_id": a}), ("freeze_account", {"account_id": a})]
        checks = [
            (f"{a} is frozen", ret(f"final_state['accounts'][{a!r}]['frozen'] is True")),
            (
                f"{b} is unchanged",
                ret(
                    close(f"final_state['accounts'][{b!r}]['balance']", f"initial_state['accounts'][{b!r}]['balance']")
                ),
            ),
        ]
    return Goal(text, calls, checks, {a, b})


def bank_sweep(rng: random.Random, world: World) -> Goal | None:
    free = _acc(world, frozen=False)
    if len(free) < 2:
        return None
    a, b = rng.sample(free, 2)
    balance = world.config["accounts"][a]["balance"]
    balance = int(balance) if float(balance).is_integer() else balance
    return Goal(
        f"Move the entire balance of account {a} to account {b}.",
        [
            ("get_balance", {"account_id": a}),
            ("transfer", {"from_account_id": a, "to_account_id": b, "amount": balance}),
        ],
        [(f"{a} is empty", ret(close(f"final_state['accounts'][{a!r}]['balance']", "0"))), _balance_checks(b, balance)],
        {a, b},
    )


def bank_freeze_owner(rng: random.Random, world: World) -> Goal | None:
    accounts = world.config["accounts"]
    owners = sorted({v["owner"] for v in accounts.values()})
    options = []
    for owner in owners:
        mine = [a for a, v in accounts.items() if v["owner"] == owner]
        todo = [a for a in mine if not accounts[a]["frozen"]]
        if len(mine) >= 2 and todo and not set(mine) & world.used and f"owner:{owner}" not in world.used:
            options.append((owner, mine, todo))
    if not options:
        return None
    owner, mine, todo = rng.choice(options)
    calls: list[Call] = [("list_accounts", {"owner": owner})] + [("freeze_account", {"account_id": a}) for a in todo]
    return Goal(
        f"Freeze every account of {owner}.",
        calls,
        [(f"{a} is frozen", ret(f"final_state['accounts'][{a!r}]['frozen'] is True")) for a in mine],
        {*mine, f"owner:{owner}"},
    )


BANK = [
    bank_transfer,
    bank_freeze,
    bank_pay,
    bank_transfer_owner,
    bank_pay_payee,
    bank_pay_payee_owner,
    bank_conditional,
    bank_sweep,
    bank_freeze_owner,
]


# --------------------------------------------------------------------------------------------- calendar

TITLES = [
    "Budget review",
    "Team standup",
    "Dentist appointment",
    "Lunch with Sam",
    "Project kickoff",
    "Design critique",
    "Yoga class",
    "Quarterly planning",
    "Client call",
    "Code review",
    "Piano lesson",
    "Board meeting",
    "Hiring interview",
    "Book club",
    "Car service",
    "Parent meeting",
    "Release retro",
    "Sales sync",
]
NEW_TITLES = [
    "Coffee with Ana",
    "Training session",
    "Vendor demo",
    "Doctor visit",
    "Offsite prep",
    "Tax review",
    "Roadmap chat",
    "Gym session",
    "Team lunch",
    "Security audit",
]
DATES = ["2025-05-12", "2025-05-13", "2025-05-14", "2025-05-15", "2025-05-16"]


def _hm(minutes: int) -> str:
    return f"{minutes // 60:02d}:{minutes % 60:02d}"


def calendar_world(rng: random.Random) -> dict[str, Any]:
    events: dict[str, dict[str, Any]] = {}
    number = rng.randint(10, 60)
    for title in rng.sample(TITLES, rng.randint(5, 8)):
        for _ in range(20):
            date = rng.choice(DATES)
            start = rng.randrange(8 * 60, 17 * 60, 30)
            end = start + rng.choice([30, 60, 90])
            clash = any(
                e["date"] == date
                and start < int(e["end"][:2]) * 60 + int(e["end"][3:])
                and int(e["start"][:2]) * 60 + int(e["start"][3:]) < end
                for e in events.values()
            )
            if not clash:
                events[f"EV-{number}"] = {
                    "title": title,
                    "date": date,
                    "start": _hm(start),
                    "end": _hm(end),
                    "attendees": rng.sample(PEOPLE, rng.randint(0, 3)),
                }
                number += 1
                break
    return {"events": events, "next_event_number": number}


def _free_slot(rng: random.Random, world: World, date: str, length: int) -> tuple[str, str] | None:
    busy = [(e["start"], e["end"]) for e in world.config["events"].values() if e["date"] == date]
    options = []
    for start in range(8 * 60, 18 * 60, 30):
        s, e = _hm(start), _hm(start + length)
        if all(not (s < b_end and b_start < e) for b_start, b_end in busy):
            options.append((s, e))
    return rng.choice(options) if options else None


def _events(world: World) -> list[str]:
    return world.free(world.config["events"])


def _unique_title_events(world: World) -> list[str]:
    events = world.config["events"]
    return [
        e for e in _events(world) if sum(events[e]["title"].lower() in v["title"].lower() for v in events.values()) == 1
    ]


def _event_exists(title: str, date: str, start: str, end: str, attendee: str | None = None) -> str:
    cond = f"e['title'] == {title!r} and e['date'] == {date!r} and e['start'] == {start!r} and e['end'] == {end!r}"
    if attendee:
        cond += f" and {attendee!r} in e['attendees']"
    return ret(f"any({cond} for e in final_state['events'].values())")


def _new_title(rng: random.Random, world: World) -> str | None:
    titles = {v["title"] for v in world.config["events"].values()}
    options = [t for t in NEW_TITLES if t not in titles and f"title:{t}" not in world.used]
    return pick(rng, options)


def cal_create(rng: random.Random, world: World) -> Goal | None:
    title, date = _new_title(rng, world), rng.choice(DATES)
    slot = _free_slot(rng, world, date, rng.choice([30, 60]))
    if title is None or slot is None or f"date:{date}" in world.used:
        return None
    s, e = slot
    return Goal(
        f"Create an event titled '{title}' on {date} from {s} to {e}.",
        [("create_event", {"title": title, "date": date, "start": s, "end": e})],
        [(f"'{title}' exists on {date} {s}-{e}", _event_exists(title, date, s, e))],
        {f"title:{title}", f"date:{date}"},
    )


def cal_cancel(rng: random.Random, world: World) -> Goal | None:
    ev = pick(rng, _events(world))
    if ev is None:
        return None
    date = world.config["events"][ev]["date"]
    return Goal(
        f"Cancel event {ev}.",
        [("cancel_event", {"event_id": ev})],
        [(f"{ev} is cancelled", ret(f"{ev!r} not in final_state['events']"))],
        {ev, f"date:{date}"},
    )


def cal_add_attendee(rng: random.Random, world: World) -> Goal | None:
    ev = pick(rng, _events(world))
    if ev is None:
        return None
    person = rng.choice([p for p in PEOPLE if p not in world.config["events"][ev]["attendees"]])
    return Goal(
        f"Add {person} to event {ev}.",
        [("add_attendee", {"event_id": ev, "name": person})],
        [(f"{person} attends {ev}", ret(f"{person!r} in final_state['events'][{ev!r}]['attendees']"))],
        {ev},
    )


def cal_remove_attendee(rng: random.Random, world: World) -> Goal | None:
    ev = pick(rng, [e for e in _events(world) if world.config["events"][e]["attendees"]])
    if ev is None:
        return None
    person = rng.choice(world.config["events"][ev]["attendees"])
    return Goal(
        f"Remove {person} from event {ev}.",
        [("remove_attendee", {"event_id": ev, "name": person})],
        [
            (f"{person} no longer attends {ev}", ret(f"{person!r} not in final_state['events'][{ev!r}]['attendees']")),
            (f"{ev} still exists", ret(f"{ev!r} in final_state['events']")),
        ],
        {ev},
    )


def cal_reschedule(rng: random.Random, world: World) -> Goal | None:
    ev = pick(rng, _events(world))
    date = rng.choice(DATES)
    if ev is None or f"date:{date}" in world.used:
        return None
    old = world.config["events"][ev]
    slot = _free_slot(rng, world, date, 60)
    if slot is None or (date, slot[0]) == (old["date"], old["start"]):
        return None
    s, e = slot
    return Goal(
        f"Move event {ev} to {date} from {s} to {e}.",
        [("move_event", {"event_id": ev, "date": date, "start": s, "end": e})],
        [
            (
                f"{ev} is on {date} {s}-{e}",
                ret(
                    f"final_state['events'][{ev!r}]['date'] == {date!r} and "
                    f"final_state['events'][{ev!r}]['start'] == {s!r} and "
                    f"final_state['events'][{ev!r}]['end'] == {e!r}"
                ),
            )
        ],
        {ev, f"date:{date}", f"date:{old['date']}"},
    )


def cal_cancel_title(rng: random.Random, world: World) -> Goal | None:
    ev = pick(rng, _unique_title_events(world))
    if ev is None:
        return None
    title, date = world.config["events"][ev]["title"], world.config["events"][ev]["date"]
    return Goal(
        f"Cancel the '{title}' event.",
        [("find_events", {"title": title}), ("cancel_event", {"event_id": ev})],
        [(f"'{title}' is cancelled", ret(f"{ev!r} not in final_state['events']"))],
        {ev, f"date:{date}"},
    )


def cal_add_attendee_title(rng: random.Random, world: World) -> Goal | None:
    ev = pick(rng, _unique_title_events(world))
    if ev is None:
        return None
    title = world.config["events"][ev]["title"]
    person = rng.choice([p for p in PEOPLE if p not in world.config["events"][ev]["attendees"]])
    return Goal(
        f"Add {person} to the '{title}' event.",
        [("find_events", {"title": title}), ("add_attendee", {"event_id": ev, "name": person})],
        [(f"{person} attends '{title}'", ret(f"{person!r} in final_state['events'][{ev!r}]['attendees']"))],
        {ev},
    )


def cal_create_invite(rng: random.Random, world: World) -> Goal | None:
    title, date = _new_title(rng, world), rng.choice(DATES)
    slot = _free_slot(rng, world, date, 60)
    if title is None or slot is None or f"date:{date}" in world.used:
        return None
    s, e = slot
    person = rng.choice(PEOPLE)
    new_id = last_created("events", "event_id")
    return Goal(
        f"Create an event titled '{title}' on {date} from {s} to {e} and invite {person}.",
        [
            ("create_event", {"title": title, "date": date, "start": s, "end": e}),
            lambda env: ("add_attendee", {"event_id": new_id(env), "name": person}),
        ],
        [
            (f"'{title}' exists on {date} {s}-{e}", _event_exists(title, date, s, e)),
            (f"{person} attends '{title}'", _event_exists(title, date, s, e, person)),
        ],
        {f"title:{title}", f"date:{date}"},
    )


def cal_clear_day(rng: random.Random, world: World) -> Goal | None:
    events = world.config["events"]
    options = []
    for date in DATES:
        day = [e for e, v in events.items() if v["date"] == date]
        if 2 <= len(day) <= 3 and not set(day) & world.used and f"date:{date}" not in world.used:
            options.append((date, day))
    if not options:
        return None
    date, day = rng.choice(options)
    calls: list[Call] = [("list_events", {"date": date})] + [("cancel_event", {"event_id": e}) for e in sorted(day)]
    return Goal(
        f"Cancel every event on {date}.",
        calls,
        [(f"no events on {date}", ret(f"not any(e['date'] == {date!r} for e in final_state['events'].values())"))],
        {*day, f"date:{date}"},
    )


def cal_move_day(rng: random.Random, world: World) -> Goal | None:
    ev = pick(rng, _unique_title_events(world))
    if ev is None:
        return None
    old = world.config["events"][ev]
    date = rng.choice([d for d in DATES if d != old["date"]])
    busy = [(e["start"], e["end"]) for e in world.config["events"].values() if e["date"] == date]
    if f"date:{date}" in world.used or any(old["start"] < b and a < old["end"] for a, b in busy):
        return None
    return Goal(
        f"Move the '{old['title']}' event to {date}, keeping its start and end times.",
        [
            ("find_events", {"title": old["title"]}),
            ("move_event", {"event_id": ev, "date": date, "start": old["start"], "end": old["end"]}),
        ],
        [
            (f"'{old['title']}' is on {date}", ret(f"final_state['events'][{ev!r}]['date'] == {date!r}")),
            (
                "its times are unchanged",
                ret(
                    f"final_state['events'][{ev!r}]['start'] == {old['start']!r} and "
                    f"final_state['events'][{ev!r}]['end'] == {old['end']!r}"
                ),
            ),
        ],
        {ev, f"date:{date}", f"date:{old['date']}"},
    )


CALENDAR = [
    cal_create,
    cal_cancel,
    cal_add_attendee,
    cal_remove_attendee,
    cal_reschedule,
    cal_cancel_title,
    cal_add_attendee_title,
    cal_create_invite,
    cal_clear_day,
    cal_move_day,
]


# ------------------------------------------------------------------------------------------------- shop

PRODUCTS = [
    "desk lamp",
    "office chair",
    "water bottle",
    "yoga mat",
    "coffee grinder",
    "notebook",
    "backpack",
    "phone charger",
    "wall clock",
    "tea kettle",
    "bike helmet",
    "umbrella",
]


def shop_world(rng: random.Random) -> dict[str, Any]:
    products = {}
    for name, number in zip(rng.sample(PRODUCTS, 6), rng.sample(range(1000, 9999), 6), strict=True):
        products[f"SKU-{number}"] = {"name": name, "price": float(rng.randrange(5, 200)), "stock": rng.randint(3, 40)}
    orders = {}
    number = rng.randint(1, 40)
    for customer in rng.sample(PEOPLE, 3):
        for _ in range(rng.randint(1, 2)):
            sku = rng.choice(sorted(products))
            quantity = rng.randint(1, 3)
            orders[f"ORD-{number}"] = {
                "customer": customer,
                "sku": sku,
                "quantity": quantity,
                "total": round(products[sku]["price"] * quantity, 2),
                "status": rng.choice(["placed", "placed", "shipped"]),
            }
            number += 1
    return {"products": products, "orders": orders, "next_order_number": number}


def _skus(world: World) -> list[str]:
    return world.free(world.config["products"])


def shop_restock(rng: random.Random, world: World) -> Goal | None:
    sku = pick(rng, _skus(world))
    if sku is None:
        return None
    n = rng.randint(2, 30)
    return Goal(
        f"Restock product {sku} with {n} units.",
        [("restock", {"sku": sku, "quantity": n})],
        [
            (
                f"{sku} stock grew by {n}",
                ret(f"final_state['products'][{sku!r}]['stock'] == initial_state['products'][{sku!r}]['stock'] + {n}"),
            )
        ],
        {sku},
    )


def shop_price(rng: random.Random, world: World) -> Goal | None:
    sku = pick(rng, _skus(world))
    if sku is None:
        return None
    price = rng.randrange(5, 250)
    if price == world.config["products"][sku]["price"]:
        return None
    return Goal(
        f"Set the price of product {sku} to {price:g} dollars.",
        [("set_price", {"sku": sku, "price": price})],
        [(f"{sku} costs {price:g}", ret(close(f"final_state['products'][{sku!r}]['price']", repr(price))))],
        {sku},
    )


def _order_checks(customer: str, sku: str, q: int) -> list[tuple[str, str]]:
    return [
        (
            f"{customer} has a placed order of {q} x {sku}",
            ret(
                f"any(o['customer'] == {customer!r} and o['sku'] == {sku!r} and "
                f"o['quantity'] == {q} and "
                f"o['status'] == 'placed' for o in final_state['orders'].values())"
            ),
        ),
        (
            f"{sku} stock dropped by {q}",
            ret(f"final_state['products'][{sku!r}]['stock'] == initial_state['products'][{sku!r}]['stock'] - {q}"),
        ),
    ]


def _new_customer(rng: random.Random, world: World) -> str | None:
    customers = {o["customer"] for o in world.config["orders"].values()}
    return pick(rng, [p for p in PEOPLE if p not in customers and f"customer:{p}" not in world.used])


def shop_order(rng: random.Random, world: World) -> Goal | None:
    sku, customer = pick(rng, _skus(world)), _new_customer(rng, world)
    if sku is None or customer is None:
        return None
    q = rng.randint(1, min(3, world.config["products"][sku]["stock"]))
    return Goal(
        f"Order {q} units of product {sku} for {customer}.",
        [("place_order", {"customer": customer, "sku": sku, "quantity": q})],
        _order_checks(customer, sku, q),
        {sku, f"customer:{customer}"},
    )


def _placed(world: World) -> list[str]:
    orders = world.config["orders"]
    return [o for o in world.free(orders) if orders[o]["status"] == "placed" and orders[o]["sku"] not in world.used]


def _cancel_checks(order: str, sku: str, q: int) -> list[tuple[str, str]]:
    return [
        (f"{order} is cancelled", ret(f"final_state['orders'][{order!r}]['status'] == 'cancelled'")),
        (
            f"{q} units of {sku} are back in stock",
            ret(f"final_state['products'][{sku!r}]['stock'] == initial_state['products'][{sku!r}]['stock'] + {q}"),
        ),
    ]


def shop_cancel(rng: random.Random, world: World) -> Goal | None:
    order = pick(rng, _placed(world))
    if order is None:
        return None
    o = world.config["orders"][order]
    return Goal(
        f"Cancel order {order}.",
        [("cancel_order", {"order_id": order})],
        _cancel_checks(order, o["sku"], o["quantity"]),
        {order, o["sku"], f"customer:{o['customer']}"},
    )


def shop_order_by_name(rng: random.Random, world: World) -> Goal | None:
    skus = [
        s
        for s in _skus(world)
        if sum(world.config["products"][s]["name"] in v["name"] for v in world.config["products"].values()) == 1
    ]
    sku, customer = pick(rng, skus), _new_customer(rng, world)
    if sku is None or customer is None:
        return None
    name = world.config["products"][sku]["name"]
    q = rng.randint(1, min(3, world.config["products"][sku]["stock"]))
    return Goal(
        f"Order {q} units of the {name} for {customer}.",
        [("search_products", {"query": name}), ("place_order", {"customer": customer, "sku": sku, "quantity": q})],
        _order_checks(customer, sku, q),
        {sku, f"customer:{customer}"},
    )


def shop_price_by_name(rng: random.Random, world: World) -> Goal | None:
    sku = pick(rng, _skus(world))
    if sku is None:
        return None
    name = world.config["products"][sku]["name"]
    price = rng.randrange(5, 250)
    if price == world.config["products"][sku]["price"]:
        return None
    return Goal(
        f"Set the price of the {name} to {price:g} dollars.",
        [("search_products", {"query": name}), ("set_price", {"sku": sku, "price": price})],
        [(f"the {name} costs {price:g}", ret(close(f"final_state['products'][{sku!r}]['price']", repr(price))))],
        {sku},
    )


def shop_cancel_customer(rng: random.Random, world: World) -> Goal | None:
    orders = world.config["orders"]
    options = []
    for customer in sorted({o["customer"] for o in orders.values()}):
        mine = [o for o, v in orders.items() if v["customer"] == customer]
        placed = [o for o in mine if orders[o]["status"] == "placed"]
        skus = {orders[o]["sku"] for o in placed}
        if placed and not set(mine) & world.used and not skus & world.used and f"customer:{customer}" not in world.used:
            options.append((customer, mine, placed))
    if not options:
        return None
    customer, mine, placed = rng.choice(options)
    text = f"Cancel {customer}'s open order." if len(placed) == 1 else f"Cancel all of {customer}'s open orders."
    calls: list[Call] = [("list_orders", {"customer": customer})] + [("cancel_order", {"order_id": o}) for o in placed]
    checks = [(f"{o} is cancelled", ret(f"final_state['orders'][{o!r}]['status'] == 'cancelled'")) for o in placed]
    touched = {orders[o]["sku"] for o in placed}
    return Goal(text, calls, checks, {*mine, *touched, f"customer:{customer}"})


def shop_restock_to(rng: random.Random, world: World) -> Goal | None:
    sku = pick(rng, _skus(world))
    if sku is None:
        return None
    stock = world.config["products"][sku]["stock"]
    target = stock + rng.randint(5, 40)
    target -= target % 5
    if target <= stock:
        return None
    return Goal(
        f"Restock product {sku} so that exactly {target} units are in stock.",
        [("get_product", {"sku": sku}), ("restock", {"sku": sku, "quantity": target - stock})],
        [(f"{sku} has {target} units", ret(f"final_state['products'][{sku!r}]['stock'] == {target}"))],
        {sku},
    )


SHOP = [
    shop_restock,
    shop_price,
    shop_order,
    shop_cancel,
    shop_order_by_name,
    shop_price_by_name,
    shop_cancel_customer,
    shop_restock_to,
]


# ------------------------------------------------------------------------------------------------ files

FOLDERS = ["/docs", "/photos", "/music", "/projects", "/projects/alpha", "/projects/beta", "/archive", "/inbox"]
FILE_NAMES = [
    "report.txt",
    "notes.txt",
    "todo.txt",
    "budget.csv",
    "summary.md",
    "draft.txt",
    "invoice.txt",
    "readme.md",
    "ideas.txt",
    "plan.txt",
    "minutes.txt",
    "letter.txt",
    "recipes.txt",
    "contacts.csv",
]
CONTENTS = [
    "Q3 numbers look fine",
    "call the plumber",
    "milk, eggs, bread",
    "total: 1200",
    "ship v2 in June",
    "meeting moved to Friday",
    "invoice 88 paid",
    "draft for review",
    "new logo ideas",
    "keep it short",
]
NEW_FOLDERS = ["/docs/old", "/projects/gamma", "/backup", "/shared", "/photos/2024", "/music/live"]


def files_world(rng: random.Random) -> dict[str, Any]:
    folders = sorted(rng.sample(FOLDERS, 5))
    folders = sorted({f for f in folders if f.count("/") == 1 or f.rsplit("/", 1)[0] in folders})
    files = {}
    for name in rng.sample(FILE_NAMES, rng.randint(6, 9)):
        files[f"{rng.choice(folders)}/{name}"] = rng.choice(CONTENTS)
    return {"files": dict(sorted(files.items())), "folders": folders}


def _parent(path: str) -> str:
    return path.rsplit("/", 1)[0] or "/"


def _files(world: World) -> list[str]:
    return [f for f in world.free(world.config["files"]) if f"folder:{_parent(f)}" not in world.used]


def _file_gone(path: str) -> tuple[str, str]:
    return (f"{path} no longer exists", ret(f"{path!r} not in final_state['files']"))


def _file_is(path: str, content_expr: str) -> tuple[str, str]:
    return (f"{path} has the expected content", ret(f"final_state['files'].get({path!r}) == {content_expr}"))


def fs_create_folder(rng: random.Random, world: World) -> Goal | None:
    options = [
        f
        for f in NEW_FOLDERS
        if f not in world.config["folders"]
        and f"new:{f}" not in world.used
        and _parent(f) in ["/", *world.config["folders"]]
        and f"folder:{_parent(f)}" not in world.used
    ]
    path = pick(rng, options)
    if path is None:
        return None
    return Goal(
        f"Create the folder {path}.",
        [("create_folder", {"path": path})],
        [(f"{path} exists", ret(f"{path!r} in final_state['folders']"))],
        {f"new:{path}"},
    )


def fs_write(rng: random.Random, world: World) -> Goal | None:
    folder = rng.choice(world.config["folders"])
    name = rng.choice(["memo.txt", "agenda.txt", "log.txt", "list.txt", "hello.txt"])
    path = f"{folder}/{name}"
    if path in world.config["files"] or f"new:{path}" in world.used or f"folder:{folder}" in world.used:
        return None
    text = rng.choice(CONTENTS)
    return Goal(
        f"Write the file {path} with the text '{text}'.",
        [("write_file", {"path": path, "content": text})],
        [_file_is(path, repr(text))],
        {f"new:{path}"},
    )


def fs_delete(rng: random.Random, world: World) -> Goal | None:
    path = pick(rng, _files(world))
    if path is None:
        return None
    return Goal(f"Delete the file {path}.", [("delete_file", {"path": path})], [_file_gone(path)], {path})


def fs_move(rng: random.Random, world: World) -> Goal | None:
    path = pick(rng, _files(world))
    if path is None:
        return None
    name = path.rsplit("/", 1)[1]
    folders = [
        f
        for f in world.config["folders"]
        if f != _parent(path) and f"{f}/{name}" not in world.config["files"] and f"folder:{f}" not in world.used
    ]
    folder = pick(rng, folders)
    if folder is None:
        return None
    dest = f"{folder}/{name}"
    return Goal(
        f"Move the file {path} into the folder {folder}.",
        [("move_file", {"source": path, "destination": folder})],
        [_file_gone(path), _file_is(dest, f"initial_state['files'][{path!r}]")],
        {path, f"new:{dest}"},
    )


def fs_rename(rng: random.Random, world: World) -> Goal | None:
    path = pick(rng, _files(world))
    if path is None:
        return None
    stem, ext = path.rsplit("/", 1)[1].rsplit(".", 1)
    new = f"{_parent(path)}/{stem}_{rng.choice(['old', 'final', 'v2', 'copy'])}.{ext}"
    if new in world.config["files"]:
        return None
    return Goal(
        f"Rename the file {path} to {new}.",
        [("move_file", {"source": path, "destination": new})],
        [_file_gone(path), _file_is(new, f"initial_state['files'][{path!r}]")],
        {path, f"new:{new}"},
    )


def fs_find_move(rng: random.Random, world: World) -> Goal | None:
    path = pick(rng, _files(world))
    if path is None:
        return None
    name = path.rsplit("/", 1)[1]
    folder = pick(rng, [f for f in world.config["folders"] if f != _parent(path) and f"folder:{f}" not in world.used])
    if folder is None:
        return None
    dest = f"{folder}/{name}"
    return Goal(
        f"Move the file named {name} into the folder {folder}.",
        [("find_files", {"name": name}), ("move_file", {"source": path, "destination": folder})],
        [_file_gone(path), _file_is(dest, f"initial_state['files'][{path!r}]")],
        {path, f"new:{dest}"},
    )


def fs_find_delete(rng: random.Random, world: World) -> Goal | None:
    path = pick(rng, _files(world))
    if path is None:
        return None
    name = path.rsplit("/", 1)[1]
    return Goal(
        f"Delete the file named {name}.",
        [("find_files", {"name": name}), ("delete_file", {"path": path})],
        [_file_gone(path)],
        {path},
    )


def fs_copy(rng: random.Random, world: World) -> Goal | None:
    path = pick(rng, _files(world))
    if path is None:
        return None
    stem, ext = path.rsplit("/", 1)[1].rsplit(".", 1)
    folder = pick(rng, [f for f in world.config["folders"] if f"folder:{f}" not in world.used])
    new = f"{folder}/{stem}_copy.{ext}"
    if new in world.config["files"] or f"new:{new}" in world.used:
        return None
    return Goal(
        f"Copy the file {path} to a new file {new}.",
        [("read_file", {"path": path}), ("write_file", {"path": new, "content": world.config["files"][path]})],
        [_file_is(new, f"initial_state['files'][{path!r}]"), _file_is(path, f"initial_state['files'][{path!r}]")],
        {path, f"new:{new}"},
    )


def fs_append(rng: random.Random, world: World) -> Goal | None:
    path = pick(rng, _files(world))
    if path is None:
        return None
    line = rng.choice(["done", "checked by Ana", "see also budget.csv", "updated today"])
    new_content = world.config["files"][path] + "\n" + line
    return Goal(
        f"Add a new last line '{line}' to the file {path}.",
        [("read_file", {"path": path}), ("write_file", {"path": path, "content": new_content})],
        [_file_is(path, f"initial_state['files'][{path!r}] + '\\n' + {line!r}")],
        {path},
    )


def fs_folder_then_move(rng: random.Random, world: World) -> Goal | None:
    path = pick(rng, _files(world))
    options = [
        f
        for f in NEW_FOLDERS
        if f not in world.config["folders"]
        and f"new:{f}" not in world.used
        and _parent(f) in ["/", *world.config["folders"]]
    ]
    folder = pick(rng, options)
    if path is None or folder is None:
        return None
    dest = f"{folder}/{path.rsplit('/', 1)[1]}"
    return Goal(
        f"Create the folder {folder} and move the file {path} into it.",
        [("create_folder", {"path": folder}), ("move_file", {"source": path, "destination": folder})],
        [
            (f"{folder} exists", ret(f"{folder!r} in final_state['folders']")),
            _file_gone(path),
            _file_is(dest, f"initial_state['files'][{path!r}]"),
        ],
        {path, f"new:{folder}", f"folder:{folder}"},
    )


def fs_clear_folder(rng: random.Random, world: World) -> Goal | None:
    files = world.config["files"]
    options = []
    for folder in world.config["folders"]:
        inside = [f for f in files if _parent(f) == folder]
        if 2 <= len(inside) <= 3 and not set(inside) & world.used and f"folder:{folder}" not in world.used:
            options.append((folder, inside))
    if not options:
        return None
    folder, inside = rng.choice(options)
    calls: list[Call] = [("list_folder", {"path": folder})] + [("delete_file", {"path": f}) for f in sorted(inside)]
    return Goal(
        f"Delete every file in the folder {folder}.",
        calls,
        [
            (
                f"{folder} holds no files",
                ret(f"not any(p.rsplit('/', 1)[0] == {folder!r} for p in final_state['files'])"),
            ),
            (f"{folder} still exists", ret(f"{folder!r} in final_state['folders']")),
        ],
        {*inside, f"folder:{folder}"},
    )


FILES = [
    fs_create_folder,
    fs_write,
    fs_delete,
    fs_move,
    fs_rename,
    fs_find_move,
    fs_find_delete,
    fs_copy,
    fs_append,
    fs_folder_then_move,
    fs_clear_folder,
]


# -------------------------------------------------------------------------------------------- messaging

TEXTS = [
    "Running 10 minutes late",
    "See you at noon",
    "Thanks for the help!",
    "Call me when you can",
    "The meeting is moved to 3pm",
    "Happy birthday!",
    "Can you send the file?",
    "Dinner at 7?",
]


def messaging_world(rng: random.Random) -> dict[str, Any]:
    contacts = {}
    number = rng.randint(1, 30)
    for name in rng.sample(PEOPLE, 5):
        contacts[f"C-{number}"] = {
            "name": name,
            "phone": f"555-{rng.randint(100, 9999):04d}",
            "blocked": rng.random() < 0.1,
        }
        number += 1
    messages = {}
    m = rng.randint(1, 80)
    for _ in range(rng.randint(4, 8)):
        cid = rng.choice(sorted(contacts))
        received = rng.random() < 0.7
        messages[f"MSG-{m}"] = {
            "direction": "received" if received else "sent",
            "contact_id": cid,
            "text": rng.choice(TEXTS),
            "read": (not received) or rng.random() < 0.4,
        }
        m += 1
    return {"contacts": contacts, "messages": messages, "next_contact_number": number, "next_message_number": m}


def _sent(cid: str, text: str) -> tuple[str, str]:
    return (
        f"'{text}' was sent to {cid}",
        ret(
            f"any(m['direction'] == 'sent' and m['contact_id'] == {cid!r} and "
            f"m['text'] == {text!r} for m in final_state['messages'].values())"
        ),
    )


def _contacts(world: World, blocked: bool | None = False) -> list[str]:
    c = world.config["contacts"]
    return [i for i in world.free(c) if blocked is None or c[i]["blocked"] == blocked]


def msg_send(rng: random.Random, world: World) -> Goal | None:
    cid = pick(rng, _contacts(world))
    if cid is None:
        return None
    text = rng.choice(TEXTS)
    return Goal(
        f"Send the message '{text}' to contact {cid}.",
        [("send_message", {"contact_id": cid, "text": text})],
        [_sent(cid, text)],
        {cid},
    )


def msg_block(rng: random.Random, world: World) -> Goal | None:
    cid = pick(rng, _contacts(world))
    if cid is None:
        return None
    return Goal(
        f"Block contact {cid}.",
        [("block_contact", {"contact_id": cid})],
        [(f"{cid} is blocked", ret(f"final_state['contacts'][{cid!r}]['blocked'] is True"))],
        {cid},
    )


def _unread(world: World) -> list[str]:
    msgs = world.config["messages"]
    return [m for m in world.free(msgs) if not msgs[m]["read"] and msgs[m]["contact_id"] not in world.used]


def msg_mark_read(rng: random.Random, world: World) -> Goal | None:
    mid = pick(rng, _unread(world))
    if mid is None:
        return None
    return Goal(
        f"Mark message {mid} as read.",
        [("mark_read", {"message_id": mid})],
        [(f"{mid} is read", ret(f"final_state['messages'][{mid!r}]['read'] is True"))],
        {mid},
    )


def msg_delete(rng: random.Random, world: World) -> Goal | None:
    mid = pick(
        rng,
        [
            m
            for m in world.free(world.config["messages"])
            if world.config["messages"][m]["contact_id"] not in world.used
        ],
    )
    if mid is None:
        return None
    return Goal(
        f"Delete message {mid}.",
        [("delete_message", {"message_id": mid})],
        [(f"{mid} is deleted", ret(f"{mid!r} not in final_state['messages']"))],
        {mid},
    )


def _new_person(rng: random.Random, world: World) -> str | None:
    names = {c["name"] for c in world.config["contacts"].values()}
    return pick(rng, [p for p in PEOPLE if p not in names and f"person:{p}" not in world.used])


def msg_add_contact(rng: random.Random, world: World) -> Goal | None:
    name = _new_person(rng, world)
    if name is None:
        return None
    phone = f"555-{rng.randint(100, 9999):04d}"
    return Goal(
        f"Add {name} as a new contact with the phone number {phone}.",
        [("add_contact", {"name": name, "phone": phone})],
        [
            (
                f"{name} is saved with {phone}",
                ret(
                    f"any(c['name'] == {name!r} and c['phone'] == {phone!r} for c in final_state['contacts'].values())"
                ),
            )
        ],
        {f"person:{name}"},
    )


def msg_send_by_name(rng: random.Random, world: World) -> Goal | None:
    cid = pick(rng, _contacts(world))
    if cid is None:
        return None
    name, text = world.config["contacts"][cid]["name"], rng.choice(TEXTS)
    return Goal(
        f"Send the message '{text}' to {name}.",
        [("find_contact", {"name": name}), ("send_message", {"contact_id": cid, "text": text})],
        [_sent(cid, text)],
        {cid},
    )


def msg_block_by_name(rng: random.Random, world: World) -> Goal | None:
    cid = pick(rng, _contacts(world))
    if cid is None:
        return None
    name = world.config["contacts"][cid]["name"]
    return Goal(
        f"Block {name}.",
        [("find_contact", {"name": name}), ("block_contact", {"contact_id": cid})],
        [(f"{name} is blocked", ret(f"final_state['contacts'][{cid!r}]['blocked'] is True"))],
        {cid},
    )


def msg_add_and_send(rng: random.Random, world: World) -> Goal | None:
    name = _new_person(rng, world)
    if name is None:
        return None
    phone, text = f"555-{rng.randint(100, 9999):04d}", rng.choice(TEXTS)
    new_id = last_created("contacts", "contact_id")
    check = ret(
        f"any(m['direction'] == 'sent' and m['text'] == {text!r} and "
        f"final_state['contacts'].get(m['contact_id'], {{}}).get('name') == {name!r} "
        "for m in final_state['messages'].values())"
    )
    return Goal(
        f"Add {name} ({phone}) as a new contact, then send them the message '{text}'.",
        [
            ("add_contact", {"name": name, "phone": phone}),
            lambda env: ("send_message", {"contact_id": new_id(env), "text": text}),
        ],
        [
            (
                f"{name} is saved",
                ret(
                    f"any(c['name'] == {name!r} and c['phone'] == {phone!r} for c in final_state['contacts'].values())"
                ),
            ),
            (f"'{text}' was sent to {name}", check),
        ],
        {f"person:{name}"},
    )


def msg_read_all(rng: random.Random, world: World) -> Goal | None:
    msgs, contacts = world.config["messages"], world.config["contacts"]
    options = []
    for cid in world.free(contacts):
        unread = [m for m, v in msgs.items() if v["contact_id"] == cid and not v["read"]]
        if unread and not set(unread) & world.used:
            options.append((cid, unread))
    if not options:
        return None
    cid, unread = rng.choice(options)
    name = contacts[cid]["name"]
    calls: list[Call] = [("find_contact", {"name": name}), ("list_messages", {"contact_id": cid, "unread_only": True})]
    calls += [("mark_read", {"message_id": m}) for m in unread]
    return Goal(
        f"Mark every unread message from {name} as read.",
        calls,
        [
            (
                f"no unread messages from {name}",
                ret(f"all(m['read'] for m in final_state['messages'].values() if m['contact_id'] == {cid!r})"),
            ),
            (f"{name}'s messages are kept", ret(f"all(m in final_state['messages'] for m in {unread!r})")),
        ],
        {cid, *unread},
    )


MESSAGING = [
    msg_send,
    msg_block,
    msg_mark_read,
    msg_delete,
    msg_add_contact,
    msg_send_by_name,
    msg_block_by_name,
    msg_add_and_send,
    msg_read_all,
]


# ----------------------------------------------------------------------------------------------- travel

CITIES = ["Lisbon", "Madrid", "Paris", "Rome", "Berlin", "Vienna", "Prague", "Dublin"]
TRIP_DATES = ["2025-06-02", "2025-06-03", "2025-06-04"]
HOTEL_NAMES = ["Grand Plaza", "River Inn", "Old Town Lodge", "Park Hotel", "City Suites", "Harbor View"]


def travel_world(rng: random.Random) -> dict[str, Any]:
    cities = rng.sample(CITIES, 4)
    flights: dict[str, dict[str, Any]] = {}
    numbers = rng.sample(range(100, 999), 12)
    for _ in range(3):
        origin, destination = rng.sample(cities, 2)
        date = rng.choice(TRIP_DATES)
        prices = rng.sample(range(60, 400, 5), rng.randint(1, 3))
        for price in prices:
            flights[f"FL-{numbers.pop()}"] = {
                "origin": origin,
                "destination": destination,
                "date": date,
                "price": float(price),
                "seats": rng.randint(1, 9),
            }
    hotels: dict[str, dict[str, Any]] = {}
    number = rng.randint(1, 40)
    for city in cities:
        for name in rng.sample(HOTEL_NAMES, rng.randint(1, 2)):
            hotels[f"HT-{number}"] = {
                "city": city,
                "name": name,
                "price_per_night": float(rng.randrange(60, 260, 5)),
                "rooms": rng.randint(1, 5),
            }
            number += 1
    bookings = {}
    b = rng.randint(1, 30)
    for traveler in rng.sample(PEOPLE, 2):
        kind = rng.choice(["flight", "hotel"])
        item = rng.choice(sorted(flights if kind == "flight" else hotels))
        bookings[f"BK-{b}"] = {
            "traveler": traveler,
            "kind": kind,
            "item_id": item,
            "nights": 0 if kind == "flight" else rng.randint(1, 4),
            "status": "confirmed",
        }
        b += 1
    return {"flights": flights, "hotels": hotels, "bookings": bookings, "next_booking_number": b}


def _traveler(rng: random.Random, world: World) -> str | None:
    existing = {b["traveler"] for b in world.config["bookings"].values()}
    return pick(rng, [p for p in PEOPLE if p not in existing and f"traveler:{p}" not in world.used])


def _booked(traveler: str, kind: str, item: str, nights: int | None = None) -> tuple[str, str]:
    cond = (
        f"b['traveler'] == {traveler!r} and b['kind'] == {kind!r} and "
        f"b['item_id'] == {item!r} and b['status'] == 'confirmed'"
    )
    if nights is not None:
        cond += f" and b['nights'] == {nights}"
    return (
        f"{traveler} has a confirmed booking of {item}",
        ret(f"any({cond} for b in final_state['bookings'].values())"),
    )


def _only_booking(traveler: str, n: int = 1) -> tuple[str, str]:
    return (
        f"{traveler} has exactly {n} new booking(s)",
        ret(f"sum(b['traveler'] == {traveler!r} for b in final_state['bookings'].values()) == {n}"),
    )


def travel_book_flight(rng: random.Random, world: World) -> Goal | None:
    fid, traveler = pick(rng, world.free(world.config["flights"])), _traveler(rng, world)
    if fid is None or traveler is None:
        return None
    return Goal(
        f"Book flight {fid} for {traveler}.",
        [("book_flight", {"flight_id": fid, "traveler": traveler})],
        [_booked(traveler, "flight", fid), _only_booking(traveler)],
        {fid, f"traveler:{traveler}"},
    )


def travel_book_hotel(rng: random.Random, world: World) -> Goal | None:
    hid, traveler = pick(rng, world.free(world.config["hotels"])), _traveler(rng, world)
    if hid is None or traveler is None:
        return None
    nights = rng.randint(1, 5)
    return Goal(
        f"Book {nights} nights at hotel {hid} for {traveler}.",
        [("book_hotel", {"hotel_id": hid, "traveler": traveler, "nights": nights})],
        [_booked(traveler, "hotel", hid, nights), _only_booking(traveler)],
        {hid, f"traveler:{traveler}"},
    )


def travel_cancel(rng: random.Random, world: World) -> Goal | None:
    bookings = world.config["bookings"]
    bid = pick(rng, [b for b in world.free(bookings) if bookings[b]["item_id"] not in world.used])
    if bid is None:
        return None
    return Goal(
        f"Cancel booking {bid}.",
        [("cancel_booking", {"booking_id": bid})],
        [(f"{bid} is cancelled", ret(f"final_state['bookings'][{bid!r}]['status'] == 'cancelled'"))],
        {bid, bookings[bid]["item_id"], f"traveler:{bookings[bid]['traveler']}"},
    )


def _routes(world: World) -> list[tuple[str, str, str, str]]:
    """(origin, destination, date, cheapest flight id) for routes whose flights are all unclaimed."""
    flights = world.config["flights"]
    out = []
    for key in sorted({(f["origin"], f["destination"], f["date"]) for f in flights.values()}):
        ids = [i for i, f in flights.items() if (f["origin"], f["destination"], f["date"]) == key]
        if set(ids) & world.used:
            continue
        cheapest = min(ids, key=lambda i: flights[i]["price"])
        out.append((*key, cheapest))
    return out


def travel_cheapest_flight(rng: random.Random, world: World) -> Goal | None:
    routes, traveler = _routes(world), _traveler(rng, world)
    if not routes or traveler is None:
        return None
    origin, destination, date, fid = rng.choice(routes)
    ids = [
        i
        for i, f in world.config["flights"].items()
        if (f["origin"], f["destination"], f["date"]) == (origin, destination, date)
    ]
    return Goal(
        f"Book the cheapest flight from {origin} to {destination} on {date} for {traveler}.",
        [
            ("search_flights", {"origin": origin, "destination": destination, "date": date}),
            ("book_flight", {"flight_id": fid, "traveler": traveler}),
        ],
        [_booked(traveler, "flight", fid), _only_booking(traveler)],
        {*ids, f"traveler:{traveler}"},
    )


def _cheapest_hotel(world: World, city: str) -> tuple[str, list[str]] | None:
    hotels = world.config["hotels"]
    ids = [i for i, h in hotels.items() if h["city"] == city]
    if not ids or set(ids) & world.used:
        return None
    return min(ids, key=lambda i: (hotels[i]["price_per_night"], i)), ids


def travel_cheapest_hotel(rng: random.Random, world: World) -> Goal | None:
    city, traveler = rng.choice(sorted({h["city"] for h in world.config["hotels"].values()})), _traveler(rng, world)
    found = _cheapest_hotel(world, city)
    if found is None or traveler is None:
        return None
    hid, ids = found
    nights = rng.randint(1, 5)
    return Goal(
        f"Book the cheapest hotel in {city} for {traveler} for {nights} nights.",
        [("search_hotels", {"city": city}), ("book_hotel", {"hotel_id": hid, "traveler": traveler, "nights": nights})],
        [_booked(traveler, "hotel", hid, nights), _only_booking(traveler)],
        {*ids, f"traveler:{traveler}"},
    )


def travel_cancel_traveler(rng: random.Random, world: World) -> Goal | None:
    bookings = world.config["bookings"]
    bid = pick(
        rng,
        [
            b
            for b in world.free(bookings)
            if bookings[b]["item_id"] not in world.used and f"traveler:{bookings[b]['traveler']}" not in world.used
        ],
    )
    if bid is None:
        return None
    traveler = bookings[bid]["traveler"]
    return Goal(
        f"Cancel {traveler}'s booking.",
        [("list_bookings", {"traveler": traveler}), ("cancel_booking", {"booking_id": bid})],
        [(f"{bid} is cancelled", ret(f"final_state['bookings'][{bid!r}]['status'] == 'cancelled'"))],
        {bid, bookings[bid]["item_id"], f"traveler:{traveler}"},
    )


def travel_trip(rng: random.Random, world: World) -> Goal | None:
    routes, traveler = _routes(world), _traveler(rng, world)
    if not routes or traveler is None:
        return None
    origin, destination, date, fid = rng.choice(routes)
    found = _cheapest_hotel(world, destination)
    if found is None:
        return None
    hid, hotel_ids = found
    nights = rng.randint(2, 4)
    ids = [
        i
        for i, f in world.config["flights"].items()
        if (f["origin"], f["destination"], f["date"]) == (origin, destination, date)
    ]
    return Goal(
        f"Book {traveler} on the cheapest flight from {origin} to {destination} on {date}, and into the "
        f"cheapest hotel in {destination} for {nights} nights.",
        [
            ("search_flights", {"origin": origin, "destination": destination, "date": date}),
            ("book_flight", {"flight_id": fid, "traveler": traveler}),
            ("search_hotels", {"city": destination}),
            ("book_hotel", {"hotel_id": hid, "traveler": traveler, "nights": nights}),
        ],
        [_booked(traveler, "flight", fid), _booked(traveler, "hotel", hid, nights), _only_booking(traveler, 2)],
        {*ids, *hotel_ids, f"traveler:{traveler}"},
    )


TRAVEL = [
    travel_book_flight,
    travel_book_hotel,
    travel_cancel,
    travel_cheapest_flight,
    travel_cheapest_hotel,
    travel_cancel_traveler,
    travel_trip,
]


# ------------------------------------------------------------------------------------------------- todo

LIST_NAMES = ["Groceries", "Work", "Home", "Garden", "Errands", "Reading", "Travel prep"]
NEW_LISTS = ["Birthday party", "Moving day", "Car", "Health", "Study plan"]
TASK_TITLES = [
    "buy milk",
    "water the plants",
    "call the bank",
    "renew passport",
    "fix the fence",
    "send the report",
    "book a haircut",
    "clean the garage",
    "pay rent",
    "read chapter 3",
    "order printer ink",
    "plan the sprint",
    "wash the car",
    "return library books",
]
NEW_TASKS = [
    "buy balloons",
    "pack boxes",
    "check tyre pressure",
    "schedule a checkup",
    "review notes",
    "buy a gift",
    "label the shelves",
]


def todo_world(rng: random.Random) -> dict[str, Any]:
    lists = {}
    number = rng.randint(1, 20)
    for name in rng.sample(LIST_NAMES, rng.randint(3, 4)):
        lists[f"L-{number}"] = {"name": name}
        number += 1
    tasks = {}
    t = rng.randint(1, 60)
    for title in rng.sample(TASK_TITLES, rng.randint(6, 9)):
        tasks[f"T-{t}"] = {
            "list_id": rng.choice(sorted(lists)),
            "title": title,
            "priority": rng.choice(["low", "normal", "normal", "high"]),
            "done": rng.random() < 0.25,
        }
        t += 1
    return {"lists": lists, "tasks": tasks, "next_list_number": number, "next_task_number": t}


def _tasks(world: World, done: bool | None = None) -> list[str]:
    tasks = world.config["tasks"]
    return [
        t
        for t in world.free(tasks)
        if (done is None or tasks[t]["done"] == done) and f"list:{tasks[t]['list_id']}" not in world.used
    ]


def _task_added(list_expr: str, title: str, priority: str | None = None) -> str:
    cond = f"t['list_id'] == {list_expr} and t['title'] == {title!r} and not t['done']"
    if priority:
        cond += f" and t['priority'] == {priority!r}"
    return ret(f"any({cond} for t in final_state['tasks'].values())")


def todo_complete(rng: random.Random, world: World) -> Goal | None:
    tid = pick(rng, _tasks(world, done=False))
    if tid is None:
        return None
    return Goal(
        f"Complete task {tid}.",
        [("complete_task", {"task_id": tid})],
        [(f"{tid} is done", ret(f"final_state['tasks'][{tid!r}]['done'] is True"))],
        {tid},
    )


def todo_add(rng: random.Random, world: World) -> Goal | None:
    lid = pick(rng, [i for i in world.free(world.config["lists"]) if f"list:{i}" not in world.used])
    title = pick(rng, [t for t in NEW_TASKS if f"title:{t}" not in world.used])
    if lid is None or title is None:
        return None
    return Goal(
        f"Add the task '{title}' to list {lid}.",
        [("add_task", {"list_id": lid, "title": title})],
        [(f"'{title}' is in {lid}", _task_added(repr(lid), title))],
        {f"title:{title}", f"list:{lid}"},
    )


def todo_priority(rng: random.Random, world: World) -> Goal | None:
    tid = pick(rng, _tasks(world))
    if tid is None:
        return None
    p = rng.choice([p for p in ("low", "normal", "high") if p != world.config["tasks"][tid]["priority"]])
    return Goal(
        f"Set the priority of task {tid} to {p}.",
        [("set_priority", {"task_id": tid, "priority": p})],
        [(f"{tid} has {p} priority", ret(f"final_state['tasks'][{tid!r}]['priority'] == {p!r}"))],
        {tid},
    )


def todo_delete(rng: random.Random, world: World) -> Goal | None:
    tid = pick(rng, _tasks(world))
    if tid is None:
        return None
    return Goal(
        f"Delete task {tid}.",
        [("delete_task", {"task_id": tid})],
        [(f"{tid} is deleted", ret(f"{tid!r} not in final_state['tasks']"))],
        {tid},
    )


def _new_list(rng: random.Random, world: World) -> str | None:
    names = {v["name"] for v in world.config["lists"].values()}
    return pick(rng, [n for n in NEW_LISTS if n not in names and f"listname:{n}" not in world.used])


def todo_create_list(rng: random.Random, world: World) -> Goal | None:
    name = _new_list(rng, world)
    if name is None:
        return None
    return Goal(
        f"Create a new list called '{name}'.",
        [("create_list", {"name": name})],
        [(f"list '{name}' exists", ret(f"any(v['name'] == {name!r} for v in final_state['lists'].values())"))],
        {f"listname:{name}"},
    )


def _unique_title_tasks(world: World, done: bool | None = None) -> list[str]:
    tasks = world.config["tasks"]
    return [t for t in _tasks(world, done) if sum(tasks[t]["title"] in v["title"] for v in tasks.values()) == 1]


def todo_complete_title(rng: random.Random, world: World) -> Goal | None:
    tid = pick(rng, _unique_title_tasks(world, done=False))
    if tid is None:
        return None
    title = world.config["tasks"][tid]["title"]
    return Goal(
        f"Mark the task '{title}' as done.",
        [("find_tasks", {"title": title}), ("complete_task", {"task_id": tid})],
        [(f"'{title}' is done", ret(f"final_state['tasks'][{tid!r}]['done'] is True"))],
        {tid},
    )


def todo_priority_title(rng: random.Random, world: World) -> Goal | None:
    tid = pick(rng, [t for t in _unique_title_tasks(world) if world.config["tasks"][t]["priority"] != "high"])
    if tid is None:
        return None
    title = world.config["tasks"][tid]["title"]
    return Goal(
        f"Give the task '{title}' high priority.",
        [("find_tasks", {"title": title}), ("set_priority", {"task_id": tid, "priority": "high"})],
        [(f"'{title}' has high priority", ret(f"final_state['tasks'][{tid!r}]['priority'] == 'high'"))],
        {tid},
    )


def todo_add_by_list_name(rng: random.Random, world: World) -> Goal | None:
    lid = pick(rng, [i for i in world.free(world.config["lists"]) if f"list:{i}" not in world.used])
    title = pick(rng, [t for t in NEW_TASKS if f"title:{t}" not in world.used])
    if lid is None or title is None:
        return None
    name, p = world.config["lists"][lid]["name"], rng.choice(["low", "high"])
    return Goal(
        f"Add the task '{title}' with {p} priority to the {name} list.",
        [("get_lists", {}), ("add_task", {"list_id": lid, "title": title, "priority": p})],
        [(f"'{title}' is in {name} with {p} priority", _task_added(repr(lid), title, p))],
        {f"title:{title}", f"list:{lid}"},
    )


def todo_create_and_add(rng: random.Random, world: World) -> Goal | None:
    name = _new_list(rng, world)
    title = pick(rng, [t for t in NEW_TASKS if f"title:{t}" not in world.used])
    if name is None or title is None:
        return None
    new_id = last_created("lists", "list_id")
    list_expr = f"next((i for i, v in final_state['lists'].items() if v['name'] == {name!r}), None)"
    return Goal(
        f"Create a list called '{name}' and add the task '{title}' to it.",
        [("create_list", {"name": name}), lambda env: ("add_task", {"list_id": new_id(env), "title": title})],
        [
            (f"list '{name}' exists", ret(f"any(v['name'] == {name!r} for v in final_state['lists'].values())")),
            (f"'{title}' is in '{name}'", _task_added(list_expr, title)),
        ],
        {f"listname:{name}", f"title:{title}"},
    )


def todo_complete_list(rng: random.Random, world: World) -> Goal | None:
    tasks, lists = world.config["tasks"], world.config["lists"]
    options = []
    for lid in world.free(lists):
        mine = [t for t, v in tasks.items() if v["list_id"] == lid]
        open_ = [t for t in mine if not tasks[t]["done"]]
        if 1 <= len(open_) <= 3 and not set(mine) & world.used and f"list:{lid}" not in world.used:
            options.append((lid, mine, open_))
    if not options:
        return None
    lid, mine, open_ = rng.choice(options)
    name = lists[lid]["name"]
    calls: list[Call] = [("get_lists", {}), ("list_tasks", {"list_id": lid})]
    calls += [("complete_task", {"task_id": t}) for t in open_]
    return Goal(
        f"Mark every task in the {name} list as done.",
        calls,
        [
            (
                f"every task in {name} is done",
                ret(f"all(t['done'] for t in final_state['tasks'].values() if t['list_id'] == {lid!r})"),
            ),
            (f"{name}'s tasks are kept", ret(f"all(t in final_state['tasks'] for t in {mine!r})")),
        ],
        {*mine, f"list:{lid}"},
    )


TODO = [
    todo_complete,
    todo_add,
    todo_priority,
    todo_delete,
    todo_create_list,
    todo_complete_title,
    todo_priority_title,
    todo_add_by_list_name,
    todo_create_and_add,
    todo_complete_list,
]


# ---------------------------------------------------------------------------------------------- registry


@dataclass(frozen=True)
class EnvSpec:
    env_id: str
    module: str  # module under lopd_core.envs.toolworld.envs
    class_name: str
    world: Callable[[random.Random], dict[str, Any]]
    goals: tuple[Callable[[random.Random, World], Goal | None], ...]


ENVIRONMENTS: tuple[EnvSpec, ...] = (
    EnvSpec("toolworld_bank", "bank", "BankEnv", bank_world, tuple(BANK)),
    EnvSpec("toolworld_calendar", "calendar_app", "CalendarEnv", calendar_world, tuple(CALENDAR)),
    EnvSpec("toolworld_shop", "shop", "ShopEnv", shop_world, tuple(SHOP)),
    EnvSpec("toolworld_files", "files", "FileSystemEnv", files_world, tuple(FILES)),
    EnvSpec("toolworld_messaging", "messaging", "MessagingEnv", messaging_world, tuple(MESSAGING)),
    EnvSpec("toolworld_travel", "travel", "TravelEnv", travel_world, tuple(TRAVEL)),
    EnvSpec("toolworld_todo", "todo", "TodoEnv", todo_world, tuple(TODO)),
    EnvSpec("toolworld_smarthome", "smarthome", "SmartHomeEnv", smarthome_world, tuple(SMARTHOME)),
)
