"""A calendar of events (a toolworld environment; this whole file is the environment's class code)."""

SUMMARY = "Calendar and meetings"
INTRODUCTION = (
    "A shared calendar. Events have an id such as EV-12, a title, a date (YYYY-MM-DD), a start and an end time "
    "(HH:MM, 24-hour clock) and a list of attendees."
)
RULES = [
    "An event must end after it starts.",
    "Two events on the same date may not overlap.",
    "A person can be an attendee of an event only once.",
]


def _minutes(text):
    hours, minutes = str(text).split(":")
    return int(hours) * 60 + int(minutes)


class CalendarEnv:
    """Events {id: {"title", "date", "start", "end", "attendees"}}; new ids come from `next_event_number`."""

    def __init__(self, init_config: dict | None = None):
        self.events = {}
        self.next_event_number = 1
        for key, value in (init_config or {}).items():
            setattr(self, key, value)

    def _check_slot(self, date, start, end, ignore=None):
        try:
            begin, finish = _minutes(start), _minutes(end)
        except ValueError:
            return "times must look like HH:MM"
        if not (0 <= begin < 24 * 60 and 0 < finish <= 24 * 60):
            return "times must lie within the day"
        if finish <= begin:
            return "an event must end after it starts"
        for event_id, event in self.events.items():
            same_day = event_id != ignore and event["date"] == date
            if same_day and begin < _minutes(event["end"]) and _minutes(event["start"]) < finish:
                return f"overlaps with {event_id} ({event['title']}, {event['start']}-{event['end']})"
        return None

    def list_events(self, date: str) -> dict:
        """List the events on one date.

        Args:
            date: The date, for example "2025-05-14".
        """
        found = [{"event_id": i, **e} for i, e in sorted(self.events.items()) if e["date"] == date]
        found.sort(key=lambda e: e["start"])
        return {"success": True, "events": found}

    def find_events(self, title: str) -> dict:
        """Find events whose title contains some text.

        Args:
            title: Part of the event title.
        """
        found = [
            {"event_id": i, **e} for i, e in sorted(self.events.items()) if title.strip().lower() in e["title"].lower()
        ]
        return {"success": True, "events": found}

    def create_event(self, title: str, date: str, start: str, end: str) -> dict:
        """Create an event.

        Args:
            title: The event title.
            date: The date, for example "2025-05-14".
            start: Start time, for example "09:30".
            end: End time, for example "10:30".
        """
        problem = self._check_slot(date, start, end)
        if problem:
            return {"success": False, "error": problem}
        event_id = f"EV-{self.next_event_number}"
        self.next_event_number += 1
        self.events[event_id] = {"title": title, "date": date, "start": start, "end": end, "attendees": []}
        return {"success": True, "event_id": event_id}

    def cancel_event(self, event_id: str) -> dict:
        """Cancel (delete) an event.

        Args:
            event_id: The event id, for example "EV-12".
        """
        if self.events.pop(event_id, None) is None:
            return {"success": False, "error": f"no event with id {event_id!r}"}
        return {"success": True, "event_id": event_id, "cancelled": True}

    def move_event(self, event_id: str, date: str, start: str, end: str) -> dict:
        """Move an event to a new date and time.

        Args:
            event_id: The event id, for example "EV-12".
            date: The new date, for example "2025-05-14".
            start: The new start time, for example "09:30".
            end: The new end time, for example "10:30".
        """
        event = self.events.get(event_id)
        if event is None:
            return {"success": False, "error": f"no event with id {event_id!r}"}
        problem = self._check_slot(date, start, end, ignore=event_id)
        if problem:
            return {"success": False, "error": problem}
        event.update(date=date, start=start, end=end)
        return {"success": True, "event_id": event_id, "date": date, "start": start, "end": end}

    def add_attendee(self, event_id: str, name: str) -> dict:
        """Add a person to an event.

        Args:
            event_id: The event id, for example "EV-12".
            name: The person's name.
        """
        event = self.events.get(event_id)
        if event is None:
            return {"success": False, "error": f"no event with id {event_id!r}"}
        if name in event["attendees"]:
            return {"success": False, "error": f"{name} already attends {event_id}"}
        event["attendees"].append(name)
        return {"success": True, "event_id": event_id, "attendees": list(event["attendees"])}

    def remove_attendee(self, event_id: str, name: str) -> dict:
        """Remove a person from an event.

        Args:
            event_id: The event id, for example "EV-12".
            name: The person's name.
        """
        event = self.events.get(event_id)
        if event is None:
            return {"success": False, "error": f"no event with id {event_id!r}"}
        if name not in event["attendees"]:
            return {"success": False, "error": f"{name} does not attend {event_id}"}
        event["attendees"].remove(name)
        return {"success": True, "event_id": event_id, "attendees": list(event["attendees"])}
