"""Scheduler service: tokenize, process images, cache, schedule, strip, stream."""
