"""Scenario templates of the travel environment (`envs/travel.py`): its random initial state and goals."""

from __future__ import annotations

import random
from typing import Any

from lopd_core.envs.toolworld.scenarios.common import PEOPLE, Goal, World, pick, ret

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
