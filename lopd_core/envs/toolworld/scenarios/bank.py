"""Scenario templates of the bank environment (`envs/bank.py`): its random initial state and goals."""

from __future__ import annotations

import random
from typing import Any

from lopd_core.envs.toolworld.scenarios.common import PEOPLE, Call, Goal, World, close, pick, ret

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
