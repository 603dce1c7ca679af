"""make test runs the Python tests with the tooling venv that scripts/setup.sh creates."""
import sys


def test_python_env_is_the_build_venv():
    # The tooling venv lives in the build tree (scripts/setup.sh creates it).
    assert "venv" in sys.prefix
