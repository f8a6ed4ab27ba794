"""Scenario templates of the shop environment (`envs/shop.py`): its random initial state and goals."""

from __future__ import annotations

import random
from typing import Any

from lopd_core.envs.toolworld.scenarios.common import PEOPLE, Call, Goal, World, close, pick, ret

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
