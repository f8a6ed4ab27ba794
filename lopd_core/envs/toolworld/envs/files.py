"""A small in-memory file system (a toolworld environment; this whole file is the environment's class code)."""

SUMMARY = "File system"
INTRODUCTION = (
    "A file system with folders and text files. Paths are absolute and use slashes, for example "
    "/docs/report.txt. The root folder / always exists."
)
RULES = [
    "A file or folder can only be created inside an existing folder.",
    "Moving a file never overwrites an existing file.",
    "Only empty folders can be deleted.",
]


def _parent(path):
    head = path.rstrip("/").rsplit("/", 1)[0]
    return head or "/"


class FileSystemEnv:
    """Files {path: content} and folders [path, ...] (the root "/" is implicit)."""

    def __init__(self, init_config: dict | None = None):
        self.files = {}
        self.folders = []
        for key, value in (init_config or {}).items():
            setattr(self, key, value)

    def _is_folder(self, path):
        return path == "/" or path in self.folders

    def list_folder(self, path: str) -> dict:
        """List the files and folders directly inside a folder.

        Args:
            path: The folder path, for example "/docs".
        """
        path = path.rstrip("/") or "/"
        if not self._is_folder(path):
            return {"success": False, "error": f"no folder {path!r}"}
        files = sorted(p for p in self.files if _parent(p) == path)
        folders = sorted(p for p in self.folders if _parent(p) == path)
        return {"success": True, "files": files, "folders": folders}

    def find_files(self, name: str) -> dict:
        """Find files anywhere whose file name contains some text.

        Args:
            name: Part of the file name.
        """
        found = sorted(p for p in self.files if name.strip().lower() in p.rsplit("/", 1)[-1].lower())
        return {"success": True, "files": found}

    def read_file(self, path: str) -> dict:
        """Read a text file.

        Args:
            path: The file path, for example "/docs/report.txt".
        """
        if path not in self.files:
            return {"success": False, "error": f"no file {path!r}"}
        return {"success": True, "path": path, "content": self.files[path]}

    def write_file(self, path: str, content: str) -> dict:
        """Create a text file or replace its content.

        Args:
            path: The file path, for example "/docs/report.txt".
            content: The full text of the file.
        """
        if not path.startswith("/") or path.endswith("/"):
            return {"success": False, "error": "a file path must start with / and name a file"}
        if not self._is_folder(_parent(path)):
            return {"success": False, "error": f"folder {_parent(path)!r} does not exist"}
        if path in self.folders:
            return {"success": False, "error": f"{path!r} is a folder"}
        self.files[path] = content
        return {"success": True, "path": path}

    def delete_file(self, path: str) -> dict:
        """Delete a file.

        Args:
            path: The file path, for example "/docs/report.txt".
        """
        if self.files.pop(path, None) is None:
            return {"success": False, "error": f"no file {path!r}"}
        return {"success": True, "path": path, "deleted": True}

    def move_file(self, source: str, destination: str) -> dict:
        """Move or rename a file.

        Args:
            source: The current file path, for example "/docs/report.txt".
            destination: The new file path, or a folder to move the file into, for example "/archive".
        """
        if source not in self.files:
            return {"success": False, "error": f"no file {source!r}"}
        destination = destination.rstrip("/") or "/"
        if self._is_folder(destination):
            destination = destination.rstrip("/") + "/" + source.rsplit("/", 1)[-1]
        if destination in self.files or destination in self.folders:
            return {"success": False, "error": f"{destination!r} already exists"}
        if not self._is_folder(_parent(destination)):
            return {"success": False, "error": f"folder {_parent(destination)!r} does not exist"}
        self.files[destination] = self.files.pop(source)
        return {"success": True, "path": destination}

    def create_folder(self, path: str) -> dict:
        """Create a folder.

        Args:
            path: The folder path, for example "/docs/archive".
        """
        path = path.rstrip("/")
        if not path.startswith("/"):
            return {"success": False, "error": "a folder path must start with /"}
        if self._is_folder(path) or path in self.files:
            return {"success": False, "error": f"{path!r} already exists"}
        if not self._is_folder(_parent(path)):
            return {"success": False, "error": f"folder {_parent(path)!r} does not exist"}
        self.folders.append(path)
        self.folders.sort()
        return {"success": True, "path": path}

    def delete_folder(self, path: str) -> dict:
        """Delete an empty folder.

        Args:
            path: The folder path, for example "/docs/archive".
        """
        path = path.rstrip("/")
        if path not in self.folders:
            return {"success": False, "error": f"no folder {path!r}"}
        if any(_parent(p) == path for p in list(self.files) + self.folders):
            return {"success": False, "error": f"folder {path!r} is not empty"}
        self.folders.remove(path)
        return {"success": True, "path": path, "deleted": True}
