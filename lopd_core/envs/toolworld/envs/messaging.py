"""A messaging app with contacts and an inbox (a toolworld environment; this file is the environment's class code)."""

SUMMARY = "Messaging and contacts"
INTRODUCTION = (
    "A phone messaging app. Contacts have an id such as C-5, a name and a phone number. Messages have an id "
    "such as MSG-21, a direction (received or sent), the contact, the text and a read flag."
)
RULES = [
    "Messages can only be sent to saved contacts that are not blocked.",
    "A phone number is written with digits and dashes, for example 555-0142.",
    "Contact names are unique.",
]


class MessagingEnv:
    """Contacts {id: {"name", "phone", "blocked"}}, messages {id: {"direction", "contact_id", "text", "read"}}."""

    def __init__(self, init_config: dict | None = None):
        self.contacts = {}
        self.messages = {}
        self.next_contact_number = 1
        self.next_message_number = 1
        for key, value in (init_config or {}).items():
            setattr(self, key, value)

    def find_contact(self, name: str) -> dict:
        """Find contacts whose name contains some text.

        Args:
            name: Part of the contact's name.
        """
        found = [
            {"contact_id": i, **c}
            for i, c in sorted(self.contacts.items())
            if name.strip().lower() in c["name"].lower()
        ]
        return {"success": True, "contacts": found}

    def add_contact(self, name: str, phone: str) -> dict:
        """Save a new contact.

        Args:
            name: The contact's full name.
            phone: The phone number, for example "555-0142".
        """
        if any(c["name"].lower() == name.strip().lower() for c in self.contacts.values()):
            return {"success": False, "error": f"a contact named {name!r} already exists"}
        if not phone or not all(ch.isdigit() or ch == "-" for ch in phone):
            return {"success": False, "error": "a phone number has only digits and dashes"}
        contact_id = f"C-{self.next_contact_number}"
        self.next_contact_number += 1
        self.contacts[contact_id] = {"name": name.strip(), "phone": phone, "blocked": False}
        return {"success": True, "contact_id": contact_id}

    def send_message(self, contact_id: str, text: str) -> dict:
        """Send a text message to a contact.

        Args:
            contact_id: The contact id, for example "C-5".
            text: The message text.
        """
        contact = self.contacts.get(contact_id)
        if contact is None:
            return {"success": False, "error": f"no contact with id {contact_id!r}"}
        if contact["blocked"]:
            return {"success": False, "error": f"contact {contact_id} is blocked"}
        if not text.strip():
            return {"success": False, "error": "the message is empty"}
        message_id = f"MSG-{self.next_message_number}"
        self.next_message_number += 1
        self.messages[message_id] = {"direction": "sent", "contact_id": contact_id, "text": text, "read": True}
        return {"success": True, "message_id": message_id}

    def list_messages(self, contact_id: str = "", unread_only: bool = False) -> dict:
        """List messages, optionally only those with one contact or only unread ones.

        Args:
            contact_id: A contact id, for example "C-5"; empty for every contact.
            unread_only: true to list only unread received messages.
        """
        found = [
            {"message_id": i, **m}
            for i, m in sorted(self.messages.items())
            if (not contact_id or m["contact_id"] == contact_id) and (not unread_only or not m["read"])
        ]
        return {"success": True, "messages": found}

    def mark_read(self, message_id: str) -> dict:
        """Mark a message as read.

        Args:
            message_id: The message id, for example "MSG-21".
        """
        message = self.messages.get(message_id)
        if message is None:
            return {"success": False, "error": f"no message with id {message_id!r}"}
        message["read"] = True
        return {"success": True, "message_id": message_id, "read": True}

    def delete_message(self, message_id: str) -> dict:
        """Delete a message.

        Args:
            message_id: The message id, for example "MSG-21".
        """
        if self.messages.pop(message_id, None) is None:
            return {"success": False, "error": f"no message with id {message_id!r}"}
        return {"success": True, "message_id": message_id, "deleted": True}

    def block_contact(self, contact_id: str) -> dict:
        """Block a contact.

        Args:
            contact_id: The contact id, for example "C-5".
        """
        contact = self.contacts.get(contact_id)
        if contact is None:
            return {"success": False, "error": f"no contact with id {contact_id!r}"}
        contact["blocked"] = True
        return {"success": True, "contact_id": contact_id, "blocked": True}
