"""Who may connect, and with what: Mosquitto's password, ACL and config files (`broker`), the
device registry (`registry`), enrollment tokens and the enrollment desk (`enrollment`), the
operator's device commands (`devices`), the files of sites and their bridges (`sites`,
`site_files`). May import `settings`; never the engine, aggregation, storage or reporting.
"""
