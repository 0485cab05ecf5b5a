//! Connecting to the etcd cluster, and the few reads every part of the cluster makes.

use anyhow::{Context, Result};
use etcd_client::{Client, ConnectOptions, GetOptions, KeyValue};
use std::time::Duration;

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

/// A client to any of `endpoints` whose requests time out after [`REQUEST_TIMEOUT`].
/// Requests need a member that sees a leader (`require_leader`): a member cut off from the
/// others answers with an error instead of its stale state, and its watches end.
pub async fn connect(endpoints: &[String]) -> Result<Client> {
    connect_with(endpoints, Some(REQUEST_TIMEOUT)).await
}

/// A client for requests that wait as long as they must (an election campaign); the
/// connection's keep-alive still notices a dead member.
pub async fn connect_patient(endpoints: &[String]) -> Result<Client> {
    connect_with(endpoints, None).await
}

async fn connect_with(endpoints: &[String], timeout: Option<Duration>) -> Result<Client> {
    let mut options = ConnectOptions::new()
        .with_connect_timeout(Duration::from_secs(2))
        .with_keep_alive(Duration::from_secs(2), Duration::from_secs(4))
        .with_keep_alive_while_idle(true)
        .with_require_leader(true);
    if let Some(t) = timeout {
        options = options.with_timeout(t);
    }
    Client::connect(endpoints, Some(options))
        .await
        .with_context(|| format!("cannot reach etcd at {}", endpoints.join(",")))
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
