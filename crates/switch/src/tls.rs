//! OpenFlow over TLS, as Open vSwitch's `ssl:`/`pssl:`: both ends show a certificate and
//! check the other's against a CA the operator names (`ca`), so only a controller holding a
//! key that CA signed programs the switch, and a switch dialling a controller knows it is that
//! controller. rustls with the `ring` provider (the API's TLS uses the same).
//!
//! ```yaml
//! sw: { type: switch, ports: [a, b], listen: "ssl:0.0.0.0:6653",
//!       cert: /etc/stitch/sw.crt, key: /etc/stitch/sw.key, ca: /etc/stitch/controllers-ca.crt }
//! ```

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use std::net::TcpStream;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

/// How an endpoint address is spoken: `tcp:HOST:PORT` (or plain `HOST:PORT`) or
/// `ssl:HOST:PORT`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transport {
    Tcp,
    Tls,
}

/// The transport and the `HOST:PORT` of an endpoint address.
pub fn split(addr: &str) -> (Transport, &str) {
    if let Some(rest) = addr.strip_prefix("ssl:") {
        (Transport::Tls, rest)
    } else {
        (Transport::Tcp, addr.strip_prefix("tcp:").unwrap_or(addr))
    }
}

/// Both sides' TLS settings, from the switch's `cert`, `key` and `ca` files.
pub struct Tls {
    pub server: Arc<rustls::ServerConfig>,
    pub client: Arc<rustls::ClientConfig>,
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn certificates(path: &Path, what: &str) -> Result<Vec<CertificateDer<'static>>, String> {
    let certs: Vec<_> = CertificateDer::pem_file_iter(path)
        .map_err(|e| format!("`{what}: {}`: {e}", path.display()))?
        .collect::<Result<_, _>>()
        .map_err(|e| format!("`{what}: {}`: {e}", path.display()))?;
    if certs.is_empty() {
        return Err(format!(
            "`{what}: {}` holds no certificate (PEM)",
            path.display()
        ));
    }
    Ok(certs)
}

impl Tls {
    /// Loads the switch's certificate chain and key and the CA its peers' certificates must
    /// come from.
    pub fn load(cert: &Path, key: &Path, ca: &Path) -> Result<Tls, String> {
        let chain = certificates(cert, "cert")?;
        // The key is a secret: Stitch's own rules for files it trusts (owner, mode, folders).
        let bytes = stitch_core::files::read_trusted(key, "OpenFlow key", true)?
            .ok_or_else(|| format!("`key: {}`: no such file", key.display()))?;
        let private = PrivateKeyDer::from_pem_slice(&bytes)
            .map_err(|e| format!("`key: {}`: {e}", key.display()))?;
        let mut roots = rustls::RootCertStore::empty();
        for c in certificates(ca, "ca")? {
            roots
                .add(c)
                .map_err(|e| format!("`ca: {}`: {e}", ca.display()))?;
        }
        let roots = Arc::new(roots);
        let verifier =
            rustls::server::WebPkiClientVerifier::builder_with_provider(roots.clone(), provider())
                .build()
                .map_err(|e| format!("`ca: {}`: {e}", ca.display()))?;
        let server = rustls::ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| e.to_string())?
            .with_client_cert_verifier(verifier)
            .with_single_cert(chain.clone(), private.clone_key())
            .map_err(|e| format!("`cert`/`key`: {e}"))?;
        let client = rustls::ClientConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| e.to_string())?
            .with_root_certificates(roots)
            .with_client_auth_cert(chain, private)
            .map_err(|e| format!("`cert`/`key`: {e}"))?;
        Ok(Tls {
            server: Arc::new(server),
            client: Arc::new(client),
        })
    }
}

/// How long a peer has for its TLS handshake.
const HANDSHAKE: Duration = Duration::from_secs(10);

/// Completes the handshake of `conn` on `tcp` (blocking, at most [`HANDSHAKE`]), then gives
/// the stream back with its read timeout as it was.
fn handshake<C, D>(
    mut conn: C,
    mut tcp: TcpStream,
) -> Result<rustls::StreamOwned<C, TcpStream>, String>
where
    C: std::ops::DerefMut<Target = rustls::ConnectionCommon<D>>,
    D: rustls::SideData,
{
    let before = tcp.read_timeout().map_err(|e| e.to_string())?;
    tcp.set_read_timeout(Some(HANDSHAKE))
        .map_err(|e| e.to_string())?;
    while conn.is_handshaking() {
        conn.complete_io(&mut tcp)
            .map_err(|e| format!("TLS handshake: {e}"))?;
    }
    tcp.set_read_timeout(before).map_err(|e| e.to_string())?;
    Ok(rustls::StreamOwned::new(conn, tcp))
}

/// A controller that connected: its certificate checked against `ca`.
pub fn accept(
    tls: &Tls,
    tcp: TcpStream,
) -> Result<rustls::StreamOwned<rustls::ServerConnection, TcpStream>, String> {
    let conn = rustls::ServerConnection::new(tls.server.clone()).map_err(|e| e.to_string())?;
    handshake(conn, tcp)
}

/// The controller at `host` dialled: its certificate must be for `host` (a name or an IP
/// address in its subject alternative names) and come from `ca`.
pub fn connect(
    tls: &Tls,
    host: &str,
    tcp: TcpStream,
) -> Result<rustls::StreamOwned<rustls::ClientConnection, TcpStream>, String> {
    let name =
        ServerName::try_from(host.to_string()).map_err(|e| format!("controller `{host}`: {e}"))?;
    let conn =
        rustls::ClientConnection::new(tls.client.clone(), name).map_err(|e| e.to_string())?;
    handshake(conn, tcp)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_name_their_transport() {
        assert_eq!(split("ssl:0.0.0.0:6653"), (Transport::Tls, "0.0.0.0:6653"));
        assert_eq!(
            split("tcp:127.0.0.1:6653"),
            (Transport::Tcp, "127.0.0.1:6653")
        );
        assert_eq!(split("127.0.0.1:6653"), (Transport::Tcp, "127.0.0.1:6653"));
    }
}
