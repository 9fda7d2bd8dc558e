"""The APIs the router serves, each described once for the turn pipeline (`base`)."""
