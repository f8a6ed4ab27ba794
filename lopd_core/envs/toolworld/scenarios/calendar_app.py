"""Scenario templates of the calendar environment (`envs/calendar_app.py`): its random initial state and goals."""

from __future__ import annotations

import random
from typing import Any

from lopd_core.envs.toolworld.scenarios.common import PEOPLE, Call, Goal, World, last_created, pick, ret

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
