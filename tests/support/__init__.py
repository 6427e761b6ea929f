"""Helpers the test suites share: where inputs live, independent re-computations, the golden JSON check."""
