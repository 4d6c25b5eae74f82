"""Test kit for Miles and its plugins: real tiny models, and the conformance checks a plugin runs
against itself (:mod:`miles.testing.conformance`)."""
