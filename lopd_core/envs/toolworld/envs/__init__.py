"""The toolworld environment classes. Each module is self-contained (standard library only): its whole source is
shipped as the environment's `env_class_code` and runs only inside the sandbox at rollout time."""
