"""Starting a cluster: its configuration, Ray, placement and the node actors."""
