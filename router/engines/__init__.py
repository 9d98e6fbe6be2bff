"""Engine instances, their health and breakers, and the decode slot ledger."""
