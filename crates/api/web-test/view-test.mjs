// Drives the live graph view of a running instance in headless Chromium:
//   node view-test.mjs BASE_URL PAGE_TOKEN ADMIN_TOKEN SCREENSHOT.png CAPTURE.pcapng
// The page is opened with PAGE_TOKEN (the capture role's) in its fragment, as an operator opens
// it; this script's own changes to the graph carry ADMIN_TOKEN.
// The instance runs `fw -> out` with no traffic. The page must draw both apps and the link;
// then this script adds a generator through the API, and the link's label must show a packet
// rate above zero within a few seconds; a click on `out` must show its counters; a click on the
// link and its capture button (1 s) must download a capture, saved to CAPTURE.pcapng, and a bad
// filter must show the instance's reason. Prints what it saw as JSON; exits non-zero on any
// failure.
import { chromium } from "playwright-core";

const [base, pageToken, adminToken, screenshot, captureFile] = process.argv.slice(2);
const link = "fw.output -> out.input";
const browser = await chromium.launch({
  executablePath: process.env.CHROMIUM || "/usr/bin/chromium",
  args: ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync"],
});
try {
  const page = await browser.newPage({ viewport: { width: 1100, height: 600 } });
  const errors = [];
  page.on("pageerror", (e) => errors.push(String(e)));
  await page.goto(base + "/#token=" + pageToken);
  const label = page.locator(`.link[data-link="${link}"] .rate`);
  await page.locator('.app[data-app="fw"]').waitFor({ timeout: 10000 });
  await page.locator('.app[data-app="out"]').waitFor();
  await page.waitForFunction((sel) => {
    const t = document.querySelector(sel);
    return t && t.textContent.startsWith("0 pps");
  }, `.link[data-link="${link}"] .rate`, { timeout: 10000 });
  const before = await label.textContent();

  const call = async (method, path, body) => {
    const r = await fetch(base + path, {
      method,
      body: JSON.stringify(body),
      headers: { Authorization: "Bearer " + adminToken, "Content-Type": "application/json" },
    });
    if (!r.ok) throw new Error(`${method} ${path}: ${r.status} ${await r.text()}`);
  };
  await call("PUT", "/api/v1/apps/gen", { type: "generator", size: 64, rate: 5000 });
  await call("POST", "/api/v1/links", "gen.output -> fw.input");

  // The page notices the new app, lays the graph out again and shows the rate.
  await page.locator('.app[data-app="gen"]').waitFor({ timeout: 10000 });
  await page.waitForFunction((sel) => {
    const t = document.querySelector(sel);
    return t && /^[1-9][0-9.]*k? pps/.test(t.textContent);
  }, `.link[data-link="${link}"] .rate`, { timeout: 15000 });
  const after = await label.textContent();

  await page.locator('.app[data-app="out"] rect').click();
  await page.locator("#counters").waitFor({ timeout: 5000 });
  const panel = await page.locator("#panel").textContent();
  if (!panel.includes("packets")) throw new Error("the counters panel shows no packets: " + panel);

  // A link: its counters and a capture downloaded as a file.
  await page.locator(`.link[data-link="${link}"] path.hit`).click({ force: true });
  await page.locator("#capture").waitFor({ timeout: 5000 });
  await page.locator('#capture input[name="seconds"]').fill("1");
  const button = await page.locator("#capture button").textContent();
  const [download] = await Promise.all([
    page.waitForEvent("download", { timeout: 15000 }),
    page.locator("#capture button").click(),
  ]);
  await download.saveAs(captureFile);
  const saved = await download.suggestedFilename();
  await page.locator('#capture input[name="filter"]').fill("udp and and");
  await page.locator("#capture button").click();
  await page.locator(".capture-status.error").waitFor({ timeout: 10000 });
  const refused = await page.locator(".capture-status").textContent();
  await page.screenshot({ path: screenshot, fullPage: true });
  if (errors.length) throw new Error("errors in the page: " + errors.join("; "));
  console.log(JSON.stringify({ before, after, panel: panel.slice(0, 200), button, saved, refused }));
} finally {
  await browser.close();
}
