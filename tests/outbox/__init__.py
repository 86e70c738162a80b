"""Tests of the transactional outbox."""
