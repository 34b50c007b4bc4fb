"""Fakes, builders and process harnesses shared by the test folders.

Imported as `support.<module>` (tests/ is on sys.path through pytest's
rootdir conftest), so no test edits `sys.path` to reach a sibling folder.
"""
