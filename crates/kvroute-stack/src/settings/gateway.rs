//! The Endpoint Picker's settings made its options, TLS and token (`--ext-proc-*`).

use super::convert::first_line;
use super::{ENV_EXT_PROC_TOKEN, Invalid, Settings};
use crate::StackError;
use kvroute_http::Credentials;

impl Settings {
    /// The Endpoint Picker's options: none when no ext_proc port is set. Its request bodies
    /// are bounded as the listener's (`--max-body-bytes-in-flight`, `-per-client`).
    pub fn epp_options(&self) -> Option<kvroute_epp::EppOptions> {
        self.gateway.ext_proc_port?;
        let d = kvroute_epp::EppOptions::default();
        let in_flight = self.listen.max_body_bytes_in_flight.unwrap_or(d.max_body_bytes_in_flight);
        Some(kvroute_epp::EppOptions {
            fallbacks: self.gateway.epp_fallbacks.unwrap_or(d.fallbacks),
            endpoint_scores: self.gateway.epp_endpoint_scores.unwrap_or(d.endpoint_scores),
            max_body_bytes_in_flight: in_flight,
            max_body_bytes_per_client: self
                .listen
                .max_body_bytes_per_client
                .unwrap_or(in_flight / 4),
            ..d
        })
    }

    /// The picker's TLS: from its certificate files (reread on change), or self-signed,
    /// offering HTTP/2 (gRPC); none for plain text.
    pub fn epp_tls(&self) -> Result<Option<std::sync::Arc<rustls::ServerConfig>>, StackError> {
        let g = &self.gateway;
        let alpn: &[&[u8]] = &[b"h2"];
        match (&g.ext_proc_tls_cert, &g.ext_proc_tls_key, g.ext_proc_self_signed) {
            (Some(cert), Some(key), _) => {
                let files = kvroute_http::tls::CertFiles::new(cert, key)?;
                Ok(Some(kvroute_http::tls::server_config(files, alpn)?))
            }
            (None, None, Some(true)) => {
                let names = self.listen.host.iter().cloned().collect::<Vec<_>>();
                Ok(Some(kvroute_http::tls::self_signed(&names, alpn)?.0))
            }
            (None, None, _) => Ok(None),
            _ => Err(Invalid::TlsPair.into()),
        }
    }

    /// The token gateways must send on the picker's port (`--ext-proc-token-file`,
    /// `KVROUTE_EXT_PROC_TOKEN`), if any.
    pub fn epp_token(&self) -> Result<Option<Credentials>, StackError> {
        let token = match (&self.gateway.ext_proc_token_file, std::env::var(ENV_EXT_PROC_TOKEN)) {
            (Some(path), _) => first_line(path)?,
            (None, Ok(token)) if !token.trim().is_empty() => token.trim().to_owned(),
            (None, _) => return Ok(None),
        };
        let origin = match &self.gateway.ext_proc_token_file {
            Some(path) => path.display().to_string(),
            None => ENV_EXT_PROC_TOKEN.to_owned(),
        };
        Ok(Some(Credentials::new([token], &origin)?))
    }
}
