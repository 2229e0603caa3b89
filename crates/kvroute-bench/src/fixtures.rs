//! Real servers the bench starts on loopback beside its fleet, which the tests borrow: a DNS
//! server ([`dns_server`], dnsmasq) and a NATS server with JetStream ([`nats_server`]). Not
//! part of a running kvroute: `serve`, `router` and `frontend` never start them.

pub mod dns_server;
pub mod nats_server;
