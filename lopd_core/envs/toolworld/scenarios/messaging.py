"""Scenario templates of the messaging environment (`envs/messaging.py`): its random initial state and goals."""

from __future__ import annotations

import random
from typing import Any

from lopd_core.envs.toolworld.scenarios.common import PEOPLE, Call, Goal, World, last_created, pick, ret

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
