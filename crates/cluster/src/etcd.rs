//! Connecting to the etcd cluster, and the few reads every part of the cluster makes.

use anyhow::{anyhow, bail, Context, Result};
use etcd_client::{
    Certificate, Client, ConnectOptions, GetOptions, Identity, KeyValue, TlsOptions,
};
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::OnceLock;
use std::time::Duration;

/// How this process proves to etcd who it is, and knows etcd is etcd: the CA etcd's
/// certificates come from, this host's (or operator's) client certificate and key — with
/// `--client-cert-auth`, etcd takes the certificate's common name as the user, whose roles
/// decide which keys it may read and write (`docs/cluster.md`, "Who may write what") — and
/// optionally a user name and password.
#[derive(Debug, Clone, Default)]
pub struct Credentials {
    pub ca: Option<PathBuf>,
    pub cert: Option<PathBuf>,
    pub key: Option<PathBuf>,
    pub user: Option<(String, String)>,
}

static CREDENTIALS: OnceLock<(Credentials, Option<TlsOptions>)> = OnceLock::new();

/// Sets the credentials every connection of this process presents (once, from the command
/// line); the files are read now, so a missing or unsafe one is an error before anything runs.
pub fn present(c: Credentials) -> Result<()> {
    let tls = match &c.ca {
        None => {
            if c.cert.is_some() || c.key.is_some() {
                bail!("--etcd-cert and --etcd-key need --etcd-ca (the CA etcd's certificates come from)");
            }
            None
        }
        Some(ca) => {
            let pem = std::fs::read(ca).with_context(|| format!("--etcd-ca {}", ca.display()))?;
            let mut tls = TlsOptions::new().ca_certificate(Certificate::from_pem(pem));
            match (&c.cert, &c.key) {
                (Some(cert), Some(key)) => {
                    let cert_pem = std::fs::read(cert)
                        .with_context(|| format!("--etcd-cert {}", cert.display()))?;
                    let key_pem = stitch_core::files::read_trusted(key, "etcd key", true)
                        .map_err(anyhow::Error::msg)?
                        .ok_or_else(|| anyhow!("--etcd-key {}: no such file", key.display()))?;
                    tls = tls.identity(Identity::from_pem(cert_pem, key_pem));
                }
                (None, None) => {}
                _ => bail!("give --etcd-cert and --etcd-key together"),
            }
            Some(tls)
        }
    };
    CREDENTIALS
        .set((c, tls))
        .map_err(|_| anyhow!("the etcd credentials are set once"))
}

/// Refuses endpoints that would trust etcd blindly: a plain `http://` one (whoever reaches it
/// can write a host's graph, which runs as root there) unless `insecure`, an `https://` one
/// without a CA.
pub fn check_endpoints(endpoints: &[String], c: &Credentials, insecure: bool) -> Result<()> {
    for e in endpoints {
        if e.starts_with("http://") && !insecure {
            bail!(
                "etcd at {e} is plain HTTP: whoever reaches it can write a host's graph, which runs as root there; give https:// endpoints with --etcd-ca and a client certificate (--etcd-cert, --etcd-key), or say --etcd-insecure on a network only the cluster's hosts reach"
            );
        }
        if e.starts_with("https://") && c.ca.is_none() {
            bail!("etcd at {e}: give --etcd-ca, the CA its certificate comes from");
        }
    }
    Ok(())
}

/// How long one request may take before the cluster counts as unreachable.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(3);

/// The comma-separated `--etcd` list as endpoints.
pub fn endpoints(list: &str) -> Vec<String> {
    list.split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(String::from)
        .collect()
}

/// A client to a member of `endpoints` that answers with a leader, whose requests time out
/// after [`REQUEST_TIMEOUT`]. Requests need a member that sees a leader (`require_leader`): a
/// member cut off from the others answers with an error instead of its stale state, and its
/// watches end.
pub async fn connect(endpoints: &[String]) -> Result<Client> {
    connect_with(endpoints, Some(REQUEST_TIMEOUT)).await
}

/// A client for requests that wait as long as they must (an election campaign); the
/// connection's keep-alive still notices a dead member.
pub async fn connect_patient(endpoints: &[String]) -> Result<Client> {
    connect_with(endpoints, None).await
}

/// How long a connection waits for etcd to elect a leader before it gives up: an election
/// takes a few election timeouts (1 s by default), longer on a busy machine, and each round of
/// tries spends the connect timeout on a member that is gone (the old leader, often).
const ELECTION_GRACE: Duration = Duration::from_secs(15);

/// Where the next connection starts trying: each connection starts one member further, so that
/// a member that keeps failing (or is cut off from the others) is not tried first every time.
static NEXT_FIRST: AtomicUsize = AtomicUsize::new(0);

/// Fails over between members itself: a client of etcd-client given several endpoints balances
/// requests over all of them, dead ones included, and a request sent to a dead member fails
/// (`tcp connect error`) although the others would answer. So each connection goes to one
/// member, the first (in turn) that answers a read needing a leader within the connect
/// timeout; when that member goes, requests fail and the caller connects again.
async fn connect_with(endpoints: &[String], timeout: Option<Duration>) -> Result<Client> {
    if endpoints.is_empty() {
        bail!("no etcd endpoint given (--etcd http://HOST:2379[,…])");
    }
    let started = std::time::Instant::now();
    let mut failures = Vec::new();
    loop {
        let first = NEXT_FIRST.fetch_add(1, Ordering::Relaxed);
        failures.clear();
        for k in 0..endpoints.len() {
            let endpoint = &endpoints[(first + k) % endpoints.len()];
            match connect_one(endpoint, timeout).await {
                Ok(client) => return Ok(client),
                Err(e) => failures.push(format!("{endpoint}: {e:#}")),
            }
        }
        // A member that answers "no leader" is in an election, which ends within a few
        // election timeouts (1 s by default): wait for it rather than fail the request.
        let electing = failures.iter().any(|f| f.contains("no leader"));
        if !electing || started.elapsed() > ELECTION_GRACE {
            break;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    bail!(
        "cannot reach a member of etcd with a leader ({}); is etcd running, and are the \
         addresses those of its client URLs (--advertise-client-urls)?",
        failures.join("; ")
    )
}

/// Keep-alive pings every 10 s, answered within 5 s: etcd's default `--grpc-keepalive-min-time`
/// is 5 s, and a client that pings more often (or while no stream is open) is told "too many
/// pings" and disconnected.
const KEEP_ALIVE_INTERVAL: Duration = Duration::from_secs(10);
const KEEP_ALIVE_TIMEOUT: Duration = Duration::from_secs(5);
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);

async fn connect_one(endpoint: &str, timeout: Option<Duration>) -> Result<Client> {
    let mut options = ConnectOptions::new()
        .with_connect_timeout(CONNECT_TIMEOUT)
        .with_keep_alive(KEEP_ALIVE_INTERVAL, KEEP_ALIVE_TIMEOUT)
        .with_keep_alive_while_idle(false)
        .with_require_leader(true);
    if let Some(t) = timeout {
        options = options.with_timeout(t);
    }
    if let Some((c, tls)) = CREDENTIALS.get() {
        if let (Some(tls), true) = (tls, endpoint.starts_with("https://")) {
            options = options.with_tls(tls.clone());
        }
        if let Some((user, password)) = &c.user {
            options = options.with_user(user, password);
        }
    }
    let mut client = Client::connect([endpoint], Some(options)).await?;
    // A read that needs a leader: a member cut off from the others, or still starting, fails
    // it. The host records: every role of the cluster may read them (`docs/cluster.md`).
    let probe = GetOptions::new().with_count_only();
    tokio::time::timeout(CONNECT_TIMEOUT, client.get(crate::keys::HOSTS, Some(probe)))
        .await
        .map_err(|_| anyhow!("no answer within {CONNECT_TIMEOUT:?}"))??;
    Ok(client)
}

/// How long a read is tried again while etcd answers that it is between leaders.
const RETRY_FOR: Duration = Duration::from_secs(3);

/// Every key under `prefix` (or just `key` when `prefix` is false) and the revision of the
/// read. A read refused while the members elect a leader is tried again for a few seconds.
async fn read(client: &mut Client, key: &str, prefix: bool) -> Result<(i64, Vec<KeyValue>)> {
    let start = std::time::Instant::now();
    loop {
        let options = prefix.then(|| GetOptions::new().with_prefix());
        match client.get(key, options).await {
            Ok(mut r) => {
                let revision = r.header().map(|h| h.revision()).unwrap_or(0);
                return Ok((revision, r.take_kvs()));
            }
            Err(e) if start.elapsed() < RETRY_FOR && is_transient(&e) => {
                log::debug!("etcd read of {key}: {e}; trying again");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => return Err(e).with_context(|| format!("cannot read {key} from etcd")),
        }
    }
}

/// Errors etcd gives while its members elect a leader or a request moves to another member.
fn is_transient(e: &etcd_client::Error) -> bool {
    let text = e.to_string();
    [
        "leader changed",
        "no leader",
        "unavailable",
        "Unavailable",
        "timed out",
        "Timeout",
    ]
    .iter()
    .any(|t| text.contains(t))
}

/// Puts `value` at `key` (an idempotent write), tried again for a few seconds while etcd
/// answers that it is between leaders.
pub async fn put_retrying(client: &mut Client, key: &str, value: Vec<u8>) -> Result<()> {
    let start = std::time::Instant::now();
    loop {
        match client.put(key, value.clone(), None).await {
            Ok(_) => return Ok(()),
            Err(e) if start.elapsed() < RETRY_FOR && is_transient(&e) => {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => return Err(e).with_context(|| format!("cannot write {key}")),
        }
    }
}

/// Every key under `prefix` and the revision of the read.
pub async fn read_prefix(client: &mut Client, prefix: &str) -> Result<(i64, Vec<KeyValue>)> {
    read(client, prefix, true).await
}

/// The value of `key` (if any) and the revision of the read.
pub async fn read_key(client: &mut Client, key: &str) -> Result<(i64, Option<KeyValue>)> {
    let (revision, kvs) = read(client, key, false).await?;
    Ok((revision, kvs.into_iter().next()))
}

/// A client for a command that runs once: a runtime of its own, blocked on.
pub fn block_on<T>(f: impl std::future::Future<Output = Result<T>>) -> Result<T> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("cannot start an async runtime")?
        .block_on(f)
}
