"""Launchers: place and run trainer ranks and engine servers, own and reap every child."""
