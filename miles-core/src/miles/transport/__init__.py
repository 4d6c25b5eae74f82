"""Weight transports: how trainer weights reach the engines (built-ins: disk, broadcast, disk_delta)."""
