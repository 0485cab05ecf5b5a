//! The container side: the veth pair, addresses and routes (through iproute2, inside the
//! container's namespace with `nsenter`), and the IPAM plugin the configuration delegates to.

use serde_json::Value;
use std::io::Write;
use std::process::{Command, Stdio};

/// Runs `cmd`; a failure is the tool's own message (`RTNETLINK answers: File exists`), for
/// the caller to say what it was doing.
fn run(cmd: &mut Command) -> Result<String, String> {
    let out = cmd
        .output()
        .map_err(|e| format!("cannot run {}: {e}", cmd.get_program().to_string_lossy()))?;
    if !out.status.success() {
        return Err(String::from_utf8_lossy(&out.stderr).trim().to_string());
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// [`ip`], a failure said as "cannot WHAT: why".
fn ip_to(what: &str, netns: Option<&str>, args: &[&str]) -> Result<String, String> {
    ip(netns, args).map_err(|why| format!("cannot {what}: {why}"))
}

/// `ip ARGS` in the namespace at `netns` (a path), or in this one.
fn ip(netns: Option<&str>, args: &[&str]) -> Result<String, String> {
    match netns {
        None => run(Command::new("ip").args(args)),
        Some(ns) => run(Command::new("nsenter")
            .arg(format!("--net={ns}"))
            .arg("ip")
            .args(args)),
    }
}

/// A veth pair: `host` here, its peer in `netns` named `ifname`; both up.
pub fn make_pair(host: &str, netns: &str, ifname: &str, mtu: u64) -> Result<(), String> {
    if !std::path::Path::new(netns).exists() {
        return Err(format!("the network namespace {netns} does not exist"));
    }
    let temp = format!("t{}", &host[1..]);
    let mtu = mtu.to_string();
    ip(
        None,
        &[
            "link", "add", host, "mtu", &mtu, "type", "veth", "peer", "name", &temp, "mtu", &mtu,
        ],
    )
    .map_err(|why| {
        if why.contains("File exists") {
            format!(
                "cannot create the veth pair {host}: it exists already — this container and \
                 interface were added before and not deleted (run DEL first)"
            )
        } else {
            format!("cannot create the veth pair {host} (MTU {mtu}): {why}")
        }
    })?;
    let inside = || -> Result<(), String> {
        ip_to(
            &format!("move {temp} into {netns}"),
            None,
            &["link", "set", &temp, "netns", netns],
        )?;
        ip_to(
            &format!("rename {temp} to {ifname} in {netns}"),
            Some(netns),
            &["link", "set", &temp, "name", ifname],
        )?;
        ip_to(
            &format!("bring {ifname} up in {netns}"),
            Some(netns),
            &["link", "set", ifname, "up"],
        )?;
        ip_to(
            &format!("bring {host} up"),
            None,
            &["link", "set", host, "up"],
        )?;
        Ok(())
    };
    inside().inspect_err(|_| delete(host))
}

/// Removes the pair (both ends) if it exists.
pub fn delete(host: &str) {
    let _ = ip(None, &["link", "del", host]);
}

/// The MAC address of `ifname` (in `netns`, or here), if it exists.
pub fn mac(netns: Option<&str>, ifname: &str) -> Option<String> {
    let out = ip(netns, &["-j", "link", "show", "dev", ifname]).ok()?;
    let v: Value = serde_json::from_str(&out).ok()?;
    v[0]["address"].as_str().map(String::from)
}

pub fn has_address(netns: &str, ifname: &str, cidr: &str) -> bool {
    let Ok(out) = ip(Some(netns), &["-j", "addr", "show", "dev", ifname]) else {
        return false;
    };
    let v: Value = serde_json::from_str(&out).unwrap_or_default();
    v[0]["addr_info"].as_array().into_iter().flatten().any(|a| {
        format!(
            "{}/{}",
            a["local"].as_str().unwrap_or_default(),
            a["prefixlen"]
        ) == cidr
    })
}

/// Runs the IPAM plugin the configuration names with `command`, as the spec says: found in
/// `CNI_PATH`, the same environment, the configuration on stdin. ADD returns its result.
pub fn ipam(config: &Value, raw: &[u8], command: &str) -> Result<Value, (u32, String)> {
    let Some(kind) = config["ipam"]["type"].as_str() else {
        return if command == "ADD" {
            Err((7, "the configuration has no `ipam` with a `type`".into()))
        } else {
            Ok(Value::Null)
        };
    };
    let path = std::env::var("CNI_PATH").unwrap_or_default();
    let program = path
        .split(':')
        .map(|d| std::path::Path::new(d).join(kind))
        .find(|p| p.is_file())
        .ok_or_else(|| {
            (
                5,
                format!("IPAM plugin `{kind}` is not in CNI_PATH ({path})"),
            )
        })?;
    let mut child = Command::new(&program)
        .env("CNI_COMMAND", command)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| (5, format!("cannot run {}: {e}", program.display())))?;
    child
        .stdin
        .take()
        .expect("a piped stdin")
        .write_all(raw)
        .map_err(|e| (5, format!("cannot write to {}: {e}", program.display())))?;
    let out = child
        .wait_with_output()
        .map_err(|e| (5, format!("{}: {e}", program.display())))?;
    let answer: Value = serde_json::from_slice(&out.stdout).unwrap_or(Value::Null);
    if !out.status.success() {
        let code = answer["code"].as_u64().unwrap_or(5) as u32;
        let msg = answer["msg"]
            .as_str()
            .map(String::from)
            .unwrap_or_else(|| String::from_utf8_lossy(&out.stderr).trim().to_string());
        return Err((code, format!("IPAM `{kind}` {command}: {msg}")));
    }
    Ok(answer)
}

/// Puts IPAM's addresses and routes on `ifname` in `netns`.
pub fn configure(netns: &str, ifname: &str, ipam: &Value) -> Result<(), String> {
    for a in ipam["ips"].as_array().into_iter().flatten() {
        let addr = a["address"]
            .as_str()
            .ok_or("IPAM gave an address without `address`")?;
        ip_to(
            &format!("give {ifname} the address {addr} that IPAM gave"),
            Some(netns),
            &["addr", "add", addr, "dev", ifname],
        )?;
    }
    let gateway_of = |v6: bool| {
        ipam["ips"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|a| a["gateway"].as_str())
            .find(|g| g.contains(':') == v6)
            .map(String::from)
    };
    for r in ipam["routes"].as_array().into_iter().flatten() {
        let dst = r["dst"].as_str().ok_or("IPAM gave a route without `dst`")?;
        let via = r["gw"]
            .as_str()
            .map(String::from)
            .or_else(|| gateway_of(dst.contains(':')));
        let mut args = vec!["route", "add", dst];
        if let Some(g) = &via {
            args.extend(["via", g.as_str()]);
        }
        args.extend(["dev", ifname]);
        ip_to(
            &format!("add the route to {dst} that IPAM gave"),
            Some(netns),
            &args,
        )?;
    }
    Ok(())
}
