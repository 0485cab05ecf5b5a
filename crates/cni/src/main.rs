//! `stitch-cni`: a CNI plugin (spec 1.0; 0.3.x and 0.4.0 results too) that attaches a
//! container's network namespace to a named port of the host's running Stitch graph.
//!
//! ADD makes a veth pair, moves one end into the container's namespace as `CNI_IFNAME`, asks
//! the IPAM plugin the configuration names (`host-local`, `static`, …: run from `CNI_PATH` as
//! the spec says) for addresses and routes and sets them, then replaces the graph's
//! `attachment` app of that name with an `af_packet` app on the host end, through the
//! instance's API — its links stay. DEL undoes all of it and puts the `attachment` back
//! (nothing there is not an error: DEL is idempotent). CHECK verifies each piece. Once the
//! port carries traffic, ADD announces the container's addresses (gratuitous ARP, unsolicited
//! neighbor advertisement), so a re-added container is reachable at once.
//!
//! ```json
//! { "cniVersion": "1.0.0", "name": "chain", "type": "stitch-cni",
//!   "control": "/run/stitch/h1.sock", "port": "web", "mtu": 1500,
//!   "ipam": { "type": "host-local", "subnet": "10.20.1.0/24", "gateway": "10.20.1.1",
//!             "routes": [ { "dst": "0.0.0.0/0" } ] } }
//! ```
//! The port may also come per container from `CNI_ARGS` (`STITCH_PORT=web`); `instance`
//! names the instance instead of `control` (an agent's instance is its host's name). On a
//! cluster host the container's MTU is what the cluster's tunnels carry (the agent's
//! `workload_mtu`), or `mtu` when that is less.

mod announce;
mod net;

use anyhow::Result;
use serde_json::{json, Value};
use std::io::Read;
use std::path::PathBuf;
use stitch_api::client::Method;

const SUPPORTED: [&str; 4] = ["0.3.0", "0.3.1", "0.4.0", "1.0.0"];

/// A failure as the spec reports it: a code (1–99 the spec's, 100+ ours) and a message.
struct CniError {
    code: u32,
    msg: String,
    details: String,
}

fn fail(code: u32, msg: impl Into<String>) -> CniError {
    CniError {
        code,
        msg: msg.into(),
        details: String::new(),
    }
}

impl From<anyhow::Error> for CniError {
    fn from(e: anyhow::Error) -> CniError {
        CniError {
            code: 5,
            msg: e.to_string(),
            details: format!("{e:#}"),
        }
    }
}

/// What every command but VERSION is given.
struct Request {
    command: String,
    container: String,
    netns: String,
    ifname: String,
    args: Vec<(String, String)>,
    config: Value,
    raw: Vec<u8>,
    version: String,
}

fn env(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.is_empty())
}

fn request(command: String) -> Result<Request, CniError> {
    let mut raw = Vec::new();
    std::io::stdin()
        .read_to_end(&mut raw)
        .map_err(|e| fail(5, format!("cannot read the network configuration: {e}")))?;
    let config: Value = serde_json::from_slice(&raw)
        .map_err(|e| fail(6, format!("the network configuration is not JSON: {e}")))?;
    let version = config["cniVersion"].as_str().unwrap_or("").to_string();
    if !SUPPORTED.contains(&version.as_str()) {
        return Err(fail(
            1,
            format!(
                "cniVersion `{version}` is not one of {}",
                SUPPORTED.join(", ")
            ),
        ));
    }
    let need = |name: &str| env(name).ok_or_else(|| fail(4, format!("{name} is not set")));
    let container = need("CNI_CONTAINERID")?;
    let ifname = need("CNI_IFNAME")?;
    // DEL may come after the namespace is gone.
    let netns = if command == "DEL" {
        env("CNI_NETNS").unwrap_or_default()
    } else {
        need("CNI_NETNS")?
    };
    let args = env("CNI_ARGS")
        .unwrap_or_default()
        .split(';')
        .filter_map(|kv| kv.split_once('='))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    Ok(Request {
        command,
        container,
        netns,
        ifname,
        args,
        config,
        raw,
        version,
    })
}

impl Request {
    /// The graph port: `STITCH_PORT` in CNI_ARGS, else the configuration's `port`.
    fn port(&self) -> Result<String, CniError> {
        let port = self
            .args
            .iter()
            .find(|(k, _)| k == "STITCH_PORT")
            .map(|(_, v)| v.clone())
            .or_else(|| self.config["port"].as_str().map(String::from))
            .ok_or_else(|| {
                fail(
                    7,
                    "name the graph port: `port` in the configuration or STITCH_PORT in CNI_ARGS",
                )
            })?;
        if port.is_empty()
            || !port
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
        {
            return Err(fail(
                7,
                format!("port `{port}`: use letters, digits, `_` and `-`"),
            ));
        }
        Ok(port)
    }

    /// The instance's API socket.
    fn control(&self) -> PathBuf {
        match (
            self.config["control"].as_str(),
            self.config["instance"].as_str(),
        ) {
            (Some(c), _) => PathBuf::from(c),
            (None, Some(i)) => stitch_api::socket_path(i),
            (None, None) => stitch_api::socket_path("stitch"),
        }
    }

    /// The container interface's MTU: what a cluster's tunnels carry (the host's agent says
    /// so in the instance's status), or less when the configuration's `mtu` says less; 1500
    /// when neither says.
    fn mtu(&self) -> u64 {
        let configured = self.config["mtu"].as_u64();
        let tunnels =
            stitch_api::client::json(&self.control(), Method::GET, "/api/v1/status", None)
                .ok()
                .and_then(|status| status["agent"]["workload_mtu"].as_u64());
        match (configured, tunnels) {
            (Some(c), Some(t)) => c.min(t),
            (Some(m), None) | (None, Some(m)) => m,
            (None, None) => 1500,
        }
    }

    /// The host end's name: a hash of container and interface, so DEL finds it again.
    fn host_end(&self) -> String {
        format!(
            "sc{:010x}",
            fnv(&format!("{}/{}", self.container, self.ifname)) & 0xff_ffff_ffff
        )
    }
}

fn fnv(s: &str) -> u64 {
    s.bytes().fold(0xcbf29ce484222325u64, |h, b| {
        (h ^ b as u64).wrapping_mul(0x100000001b3)
    })
}

/// The graph's app `port` (its entry), through the API.
fn graph_entry(r: &Request, port: &str) -> Result<Option<Value>, CniError> {
    let control = r.control();
    let (status, body) =
        stitch_api::client::call(&control, Method::GET, &format!("/api/v1/apps/{port}"), None)
            .map_err(|e| {
                fail(
                    11,
                    format!("no Stitch instance answers on {}: {e:#}", control.display()),
                )
            })?;
    match status {
        200 => Ok(serde_json::from_slice::<Value>(&body)
            .ok()
            .map(|v| v["entry"].clone())),
        404 => Ok(None),
        s => Err(fail(
            5,
            format!(
                "the instance answered {s}: {}",
                String::from_utf8_lossy(&body)
            ),
        )),
    }
}

fn put_entry(r: &Request, port: &str, entry: Value) -> Result<(), CniError> {
    stitch_api::client::json(
        &r.control(),
        Method::PUT,
        &format!("/api/v1/apps/{port}"),
        Some(entry.to_string().into_bytes()),
    )
    .map(|_| ())
    .map_err(|e| fail(5, format!("the graph refused port `{port}`: {e:#}")))
}

fn add(r: &Request) -> Result<Value, CniError> {
    let port = r.port()?;
    let host = r.host_end();
    match graph_entry(r, &port)? {
        Some(e) if e["type"] == "attachment" => {}
        Some(e) if e["type"] == "af_packet" && e["interface"] == host.as_str() => {}
        Some(e) => {
            return Err(fail(
                100,
                format!(
                    "port `{port}` of the graph is a `{}` app, not an `attachment`",
                    e["type"].as_str().unwrap_or("?")
                ),
            ))
        }
        None => {
            return Err(fail(
                100,
                format!(
                "the graph has no port `{port}`: declare it as `{port}: {{ type: attachment }}`"
            ),
            ))
        }
    }
    net::make_pair(&host, &r.netns, &r.ifname, r.mtu()).map_err(|e| fail(5, e))?;
    let undo = |e: CniError| {
        net::delete(&host);
        e
    };
    let ipam = net::ipam(&r.config, &r.raw, "ADD").map_err(|e| undo(fail(e.0, e.1)))?;
    net::configure(&r.netns, &r.ifname, &ipam).map_err(|e| undo(fail(5, e)))?;
    let entry = json!({ "type": "af_packet", "interface": host });
    if let Err(e) = put_entry(r, &port, entry.clone()) {
        let _ = net::ipam(&r.config, &r.raw, "DEL");
        return Err(undo(e));
    }
    // Kept on the host so that a restarted agent attaches the container again.
    if let Err(e) = stitch_api::attached::record(&r.control(), &port, &entry) {
        eprintln!("stitch-cni: cannot record the attachment of port `{port}`: {e}");
    }
    announce_addresses(r, &ipam);
    Ok(result(r, &host, &ipam))
}

/// The container's addresses announced on its interface (gratuitous ARP, unsolicited NA), now
/// that Stitch carries its port. Best effort: neighbours still learn the ordinary way.
fn announce_addresses(r: &Request, ipam: &Value) {
    let addresses: Vec<std::net::IpAddr> = ipam["ips"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|ip| ip["address"].as_str()?.split('/').next()?.parse().ok())
        .collect();
    let mac = net::mac(Some(&r.netns), &r.ifname).and_then(|m| stitch_wire::parse_mac(&m).ok());
    let Some(mac) = mac else {
        return;
    };
    if let Err(e) = announce::send(&r.netns, &r.ifname, announce::frames(mac, &addresses)) {
        eprintln!("stitch-cni: could not announce the container's addresses: {e}");
    }
}

/// The spec's result: both interfaces, the addresses on the container's, routes and DNS as
/// IPAM gave them.
fn result(r: &Request, host: &str, ipam: &Value) -> Value {
    let old = r.version.starts_with("0.");
    let ips: Vec<Value> = ipam["ips"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|ip| {
            let mut ip = ip.clone();
            ip["interface"] = json!(1);
            if old && ip.get("version").is_none() {
                let v6 = ip["address"].as_str().is_some_and(|a| a.contains(':'));
                ip["version"] = json!(if v6 { "6" } else { "4" });
            } else if !old {
                if let Some(o) = ip.as_object_mut() {
                    o.remove("version");
                }
            }
            ip
        })
        .collect();
    let mut out = json!({
        "cniVersion": r.version,
        "interfaces": [
            { "name": host, "mac": net::mac(None, host).unwrap_or_default() },
            { "name": r.ifname, "mac": net::mac(Some(&r.netns), &r.ifname).unwrap_or_default(), "sandbox": r.netns },
        ],
        "ips": ips,
        "routes": ipam["routes"].as_array().cloned().unwrap_or_default(),
    });
    if let Some(dns) = ipam.get("dns") {
        out["dns"] = dns.clone();
    }
    out
}

fn del(r: &Request) -> Result<(), CniError> {
    let port = r.port()?;
    let host = r.host_end();
    let recorded = stitch_api::attached::recorded(&r.control());
    if recorded
        .get(&port)
        .is_some_and(|e| e["interface"] == host.as_str())
    {
        stitch_api::attached::forget(&r.control(), &port);
    }
    if let Some(e) = graph_entry(r, &port).ok().flatten() {
        if e["type"] == "af_packet" && e["interface"] == host.as_str() {
            put_entry(r, &port, json!({ "type": "attachment" }))?;
        }
    }
    net::delete(&host);
    net::ipam(&r.config, &r.raw, "DEL").map_err(|e| fail(e.0, e.1))?;
    Ok(())
}

fn check(r: &Request) -> Result<(), CniError> {
    let port = r.port()?;
    let host = r.host_end();
    if net::mac(None, &host).is_none() {
        return Err(fail(100, format!("the host end {host} is gone")));
    }
    if net::mac(Some(&r.netns), &r.ifname).is_none() {
        return Err(fail(3, format!("{} is not in {}", r.ifname, r.netns)));
    }
    match graph_entry(r, &port)? {
        Some(e) if e["type"] == "af_packet" && e["interface"] == host.as_str() => {}
        _ => {
            return Err(fail(
                100,
                format!("port `{port}` of the graph is not attached to {host}"),
            ))
        }
    }
    for ip in r.config["prevResult"]["ips"]
        .as_array()
        .into_iter()
        .flatten()
    {
        let addr = ip["address"].as_str().unwrap_or_default();
        if !net::has_address(&r.netns, &r.ifname, addr) {
            return Err(fail(100, format!("{} lost its address {addr}", r.ifname)));
        }
    }
    net::ipam(&r.config, &r.raw, "CHECK").map_err(|e| fail(e.0, e.1))?;
    Ok(())
}

fn run() -> Result<Option<Value>, CniError> {
    let command = env("CNI_COMMAND").ok_or_else(|| fail(4, "CNI_COMMAND is not set"))?;
    if command == "VERSION" {
        return Ok(Some(
            json!({ "cniVersion": "1.0.0", "supportedVersions": SUPPORTED }),
        ));
    }
    let r = request(command)?;
    match r.command.as_str() {
        "ADD" => add(&r).map(Some),
        "DEL" => del(&r).map(|_| None),
        "CHECK" => check(&r).map(|_| None),
        other => Err(fail(
            4,
            format!("CNI_COMMAND `{other}` is not ADD, DEL, CHECK or VERSION"),
        )),
    }
}

fn main() {
    match run() {
        Ok(Some(v)) => println!("{v}"),
        Ok(None) => {}
        Err(e) => {
            println!(
                "{}",
                json!({ "cniVersion": "1.0.0", "code": e.code, "msg": e.msg, "details": e.details })
            );
            std::process::exit(1);
        }
    }
}
