"""Task lists (a toolworld environment; this whole file is the environment's class code)."""

SUMMARY = "Task lists"
INTRODUCTION = (
    "A to-do app. Lists have an id such as L-2 and a name. Tasks have an id such as T-17, the list they belong "
    "to, a title, a priority (low, normal or high) and a done flag."
)
RULES = [
    "A task belongs to exactly one existing list.",
    "Priority is one of low, normal or high.",
    "List names are unique.",
]

PRIORITIES = ("low", "normal", "high")


class TodoEnv:
    """Lists {id: {"name"}}, tasks {id: {"list_id", "title", "priority", "done"}}."""

    def __init__(self, init_config: dict | None = None):
        self.lists = {}
        self.tasks = {}
        self.next_list_number = 1
        self.next_task_number = 1
        for key, value in (init_config or {}).items():
            setattr(self, key, value)

    def get_lists(self) -> dict:
        """List all task lists."""
        return {"success": True, "lists": [{"list_id": i, **entry} for i, entry in sorted(self.lists.items())]}

    def list_tasks(self, list_id: str) -> dict:
        """List the tasks of one list.

        Args:
            list_id: The list id, for example "L-2".
        """
        if list_id not in self.lists:
            return {"success": False, "error": f"no list with id {list_id!r}"}
        found = [{"task_id": i, **t} for i, t in sorted(self.tasks.items()) if t["list_id"] == list_id]
        return {"success": True, "tasks": found}

    def find_tasks(self, title: str) -> dict:
        """Find tasks in any list whose title contains some text.

        Args:
            title: Part of the task title.
        """
        found = [
            {"task_id": i, **t} for i, t in sorted(self.tasks.items()) if title.strip().lower() in t["title"].lower()
        ]
        return {"success": True, "tasks": found}

    def create_list(self, name: str) -> dict:
        """Create a new task list.

        Args:
            name: The list name.
        """
        if any(entry["name"].lower() == name.strip().lower() for entry in self.lists.values()):
            return {"success": False, "error": f"a list named {name!r} already exists"}
        list_id = f"L-{self.next_list_number}"
        self.next_list_number += 1
        self.lists[list_id] = {"name": name.strip()}
        return {"success": True, "list_id": list_id}

    def add_task(self, list_id: str, title: str, priority: str = "normal") -> dict:
        """Add a task to a list.

        Args:
            list_id: The list id, for example "L-2".
            title: The task title.
            priority: low, normal or high, for example "normal".
        """
        if list_id not in self.lists:
            return {"success": False, "error": f"no list with id {list_id!r}"}
        if priority not in PRIORITIES:
            return {"success": False, "error": "priority must be low, normal or high"}
        task_id = f"T-{self.next_task_number}"
        self.next_task_number += 1
        self.tasks[task_id] = {"list_id": list_id, "title": title, "priority": priority, "done": False}
        return {"success": True, "task_id": task_id}

    def complete_task(self, task_id: str) -> dict:
        """Mark a task as done.

        Args:
            task_id: The task id, for example "T-17".
        """
        task = self.tasks.get(task_id)
        if task is None:
            return {"success": False, "error": f"no task with id {task_id!r}"}
        task["done"] = True
        return {"success": True, "task_id": task_id, "done": True}

    def set_priority(self, task_id: str, priority: str) -> dict:
        """Change a task's priority.

        Args:
            task_id: The task id, for example "T-17".
            priority: low, normal or high, for example "normal".
        """
        task = self.tasks.get(task_id)
        if task is None:
            return {"success": False, "error": f"no task with id {task_id!r}"}
        if priority not in PRIORITIES:
            return {"success": False, "error": "priority must be low, normal or high"}
        task["priority"] = priority
        return {"success": True, "task_id": task_id, "priority": priority}

    def delete_task(self, task_id: str) -> dict:
        """Delete a task.

        Args:
            task_id: The task id, for example "T-17".
        """
        if self.tasks.pop(task_id, None) is None:
            return {"success": False, "error": f"no task with id {task_id!r}"}
        return {"success": True, "task_id": task_id, "deleted": True}
