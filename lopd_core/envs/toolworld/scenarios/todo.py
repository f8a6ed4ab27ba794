"""Scenario templates of the todo environment (`envs/todo.py`): its random initial state and goals."""

from __future__ import annotations

import random
from typing import Any

from lopd_core.envs.toolworld.scenarios.common import Call, Goal, World, last_created, pick, ret

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
