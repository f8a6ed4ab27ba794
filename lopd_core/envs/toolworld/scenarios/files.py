"""Scenario templates of the files environment (`envs/files.py`): its random initial state and goals."""

from __future__ import annotations

import random
from typing import Any

from lopd_core.envs.toolworld.scenarios.common import Call, Goal, World, pick, ret

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
