"""Security of a run: the cluster secret and message MACs (`secret`), the keys derived from it per role (`keys`),
data-plane encryption (`encryption`), and TLS for the HTTP endpoints from a run CA (`tls`)."""
