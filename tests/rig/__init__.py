"""The test rig: a throwaway PostgreSQL, per-test databases, real daemon processes, a
freezable TCP proxy, and the pytest hooks that choose which tests run and police skips.
"""
