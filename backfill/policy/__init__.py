"""Decisions as plain objects: state snapshot or timed events in, decision out."""
