"""Smart home device control (a toolworld environment; this whole file is the environment's class code)."""

SUMMARY = "Smart home device control"
INTRODUCTION = (
    "A smart home hub. Every device has an id such as light_3, a name, a room and a kind: light, thermostat, "
    "lock or speaker. Lights have a brightness from 0 to 100, thermostats a target temperature in Celsius, "
    "locks are locked or unlocked and speakers have a volume from 0 to 100."
)
RULES = [
    "A light must be on before its brightness can be changed.",
    "A thermostat target must be between 10 and 30 degrees Celsius.",
    "Only locks can be locked or unlocked; only speakers have a volume.",
]


class SmartHomeEnv:
    """Devices {device_id: {"name", "room", "kind", "on", plus "brightness"/"target_celsius"/"locked"/"volume"}}."""

    def __init__(self, init_config: dict | None = None):
        self.devices = {}
        for key, value in (init_config or {}).items():
            setattr(self, key, value)

    def _get(self, device_id, kind=None):
        device = self.devices.get(device_id)
        if device is None:
            return None, {"success": False, "error": f"no device with id {device_id!r}"}
        if kind is not None and device["kind"] != kind:
            return None, {"success": False, "error": f"device {device_id!r} is a {device['kind']}, not a {kind}"}
        return device, None

    def list_devices(self, room: str = "") -> dict:
        """List the devices with their state, optionally only those in one room.

        Args:
            room: A room name; empty for every room.
        """
        found = [
            {"device_id": device_id, **device}
            for device_id, device in sorted(self.devices.items())
            if not room or device["room"] == room.strip().lower()
        ]
        return {"success": True, "devices": found}

    def get_device(self, device_id: str) -> dict:
        """Get one device and its state.

        Args:
            device_id: The device id, for example "light_3".
        """
        device, error = self._get(device_id)
        return error or {"success": True, "device": {"device_id": device_id, **device}}

    def turn_on(self, device_id: str) -> dict:
        """Turn a device on.

        Args:
            device_id: The device id, for example "light_3".
        """
        device, error = self._get(device_id)
        if error:
            return error
        device["on"] = True
        return {"success": True, "device_id": device_id, "on": True}

    def turn_off(self, device_id: str) -> dict:
        """Turn a device off.

        Args:
            device_id: The device id, for example "light_3".
        """
        device, error = self._get(device_id)
        if error:
            return error
        device["on"] = False
        return {"success": True, "device_id": device_id, "on": False}

    def set_brightness(self, device_id: str, level: int) -> dict:
        """Set the brightness of a light that is on.

        Args:
            device_id: The light's device id, for example "light_3".
            level: Brightness from 0 to 100, for example 50.
        """
        device, error = self._get(device_id, "light")
        if error:
            return error
        if not device["on"]:
            return {"success": False, "error": f"light {device_id!r} is off; turn it on first"}
        if not 0 <= level <= 100:
            return {"success": False, "error": "brightness must be between 0 and 100"}
        device["brightness"] = level
        return {"success": True, "device_id": device_id, "brightness": level}

    def set_temperature(self, device_id: str, celsius: int) -> dict:
        """Set a thermostat's target temperature.

        Args:
            device_id: The thermostat's device id, for example "thermostat_1".
            celsius: Target temperature in degrees Celsius from 10 to 30, for example 21.
        """
        device, error = self._get(device_id, "thermostat")
        if error:
            return error
        if not 10 <= celsius <= 30:
            return {"success": False, "error": "target must be between 10 and 30 degrees Celsius"}
        device["target_celsius"] = celsius
        return {"success": True, "device_id": device_id, "target_celsius": celsius}

    def set_volume(self, device_id: str, level: int) -> dict:
        """Set a speaker's volume.

        Args:
            device_id: The speaker's device id, for example "speaker_1".
            level: Volume from 0 to 100, for example 40.
        """
        device, error = self._get(device_id, "speaker")
        if error:
            return error
        if not 0 <= level <= 100:
            return {"success": False, "error": "volume must be between 0 and 100"}
        device["volume"] = level
        return {"success": True, "device_id": device_id, "volume": level}

    def lock(self, device_id: str) -> dict:
        """Lock a door lock.

        Args:
            device_id: The lock's device id, for example "lock_1".
        """
        device, error = self._get(device_id, "lock")
        if error:
            return error
        device["locked"] = True
        return {"success": True, "device_id": device_id, "locked": True}

    def unlock(self, device_id: str) -> dict:
        """Unlock a door lock.

        Args:
            device_id: The lock's device id, for example "lock_1".
        """
        device, error = self._get(device_id, "lock")
        if error:
            return error
        device["locked"] = False
        return {"success": True, "device_id": device_id, "locked": False}
