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

from lopd_core.envs.toolworld.scenarios.bank import BANK, bank_world
from lopd_core.envs.toolworld.scenarios.calendar_app import CALENDAR, calendar_world
from lopd_core.envs.toolworld.scenarios.common import PEOPLE, Call, EnvSpec, Goal, World, close, last_created, pick, ret
from lopd_core.envs.toolworld.scenarios.files import FILES, files_world
from lopd_core.envs.toolworld.scenarios.messaging import MESSAGING, messaging_world
from lopd_core.envs.toolworld.scenarios.shop import SHOP, shop_world
from lopd_core.envs.toolworld.scenarios.smarthome import SMARTHOME, smarthome_world
from lopd_core.envs.toolworld.scenarios.todo import TODO, todo_world
from lopd_core.envs.toolworld.scenarios.travel import TRAVEL, travel_world

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

__all__ = [
    "BANK",
    "CALENDAR",
    "ENVIRONMENTS",
    "FILES",
    "MESSAGING",
    "PEOPLE",
    "SHOP",
    "SMARTHOME",
    "TODO",
    "TRAVEL",
    "Call",
    "EnvSpec",
    "Goal",
    "World",
    "bank_world",
    "calendar_world",
    "close",
    "files_world",
    "last_created",
    "messaging_world",
    "pick",
    "ret",
    "shop_world",
    "smarthome_world",
    "todo_world",
    "travel_world",
]
