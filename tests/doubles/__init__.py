"""Engines that exist to test and measure the service: one that corrupts on purpose, one that computes nothing."""
