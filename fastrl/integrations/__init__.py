"""Adapters that let other trainers (TRL, verl, OpenRLHF) use fastrl's ops."""
