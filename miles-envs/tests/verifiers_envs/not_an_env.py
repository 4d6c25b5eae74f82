"""A module whose load_environment returns something that is not a verifiers environment."""


def load_environment(size: int = 1) -> list[int]:
    return list(range(size))
