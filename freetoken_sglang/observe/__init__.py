"""What FreeToken reports: counters, the stats document and routing traces."""
