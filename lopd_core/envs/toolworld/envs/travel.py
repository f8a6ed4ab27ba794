"""Flight and hotel booking (a toolworld environment; this whole file is the environment's class code)."""

SUMMARY = "Travel booking"
INTRODUCTION = (
    "A travel agency. Flights have an id such as FL-301, an origin and a destination city, a date, a price and "
    "free seats. Hotels have an id such as HT-12, a city, a name, a nightly price and free rooms. Bookings have "
    "an id such as BK-4, a traveler, the booked flight or hotel and a status (confirmed or cancelled)."
)
RULES = [
    "A flight needs a free seat and a hotel a free room; booking takes one.",
    "Cancelling a confirmed booking gives the seat or room back.",
    "A hotel stay lasts at least one night.",
]


class TravelEnv:
    """Flights, hotels and bookings {id: {"traveler", "kind", "item_id", "nights", "status"}}."""

    def __init__(self, init_config: dict | None = None):
        self.flights = {}
        self.hotels = {}
        self.bookings = {}
        self.next_booking_number = 1
        for key, value in (init_config or {}).items():
            setattr(self, key, value)

    def _book(self, kind, item_id, traveler, nights):
        booking_id = f"BK-{self.next_booking_number}"
        self.next_booking_number += 1
        self.bookings[booking_id] = {
            "traveler": traveler,
            "kind": kind,
            "item_id": item_id,
            "nights": nights,
            "status": "confirmed",
        }
        return booking_id

    def search_flights(self, origin: str, destination: str, date: str) -> dict:
        """Find flights between two cities on a date.

        Args:
            origin: The departure city.
            destination: The arrival city.
            date: The date, for example "2025-06-03".
        """
        found = [
            {"flight_id": i, **f}
            for i, f in sorted(self.flights.items())
            if f["origin"].lower() == origin.strip().lower()
            and f["destination"].lower() == destination.strip().lower()
            and f["date"] == date
        ]
        return {"success": True, "flights": found}

    def book_flight(self, flight_id: str, traveler: str) -> dict:
        """Book a seat on a flight.

        Args:
            flight_id: The flight id, for example "FL-301".
            traveler: The traveler's full name.
        """
        flight = self.flights.get(flight_id)
        if flight is None:
            return {"success": False, "error": f"no flight with id {flight_id!r}"}
        if flight["seats"] < 1:
            return {"success": False, "error": f"flight {flight_id} is full"}
        flight["seats"] -= 1
        return {"success": True, "booking_id": self._book("flight", flight_id, traveler, 0)}

    def search_hotels(self, city: str) -> dict:
        """Find hotels in a city.

        Args:
            city: The city.
        """
        found = [
            {"hotel_id": i, **h} for i, h in sorted(self.hotels.items()) if h["city"].lower() == city.strip().lower()
        ]
        return {"success": True, "hotels": found}

    def book_hotel(self, hotel_id: str, traveler: str, nights: int) -> dict:
        """Book a hotel room.

        Args:
            hotel_id: The hotel id, for example "HT-12".
            traveler: The traveler's full name.
            nights: Number of nights, for example 2.
        """
        hotel = self.hotels.get(hotel_id)
        if hotel is None:
            return {"success": False, "error": f"no hotel with id {hotel_id!r}"}
        if nights < 1:
            return {"success": False, "error": "a stay lasts at least one night"}
        if hotel["rooms"] < 1:
            return {"success": False, "error": f"hotel {hotel_id} has no free room"}
        hotel["rooms"] -= 1
        return {"success": True, "booking_id": self._book("hotel", hotel_id, traveler, nights)}

    def list_bookings(self, traveler: str) -> dict:
        """List a traveler's bookings.

        Args:
            traveler: The traveler's full name.
        """
        found = [
            {"booking_id": i, **b}
            for i, b in sorted(self.bookings.items())
            if b["traveler"].lower() == traveler.strip().lower()
        ]
        return {"success": True, "bookings": found}

    def cancel_booking(self, booking_id: str) -> dict:
        """Cancel a booking.

        Args:
            booking_id: The booking id, for example "BK-4".
        """
        booking = self.bookings.get(booking_id)
        if booking is None:
            return {"success": False, "error": f"no booking with id {booking_id!r}"}
        if booking["status"] != "confirmed":
            return {"success": False, "error": f"booking {booking_id} is already cancelled"}
        booking["status"] = "cancelled"
        if booking["kind"] == "flight":
            self.flights[booking["item_id"]]["seats"] += 1
        else:
            self.hotels[booking["item_id"]]["rooms"] += 1
        return {"success": True, "booking_id": booking_id, "status": "cancelled"}
