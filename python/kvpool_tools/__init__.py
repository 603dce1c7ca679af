"""kvpool Python tooling (converters; no torch needed at run time)."""
