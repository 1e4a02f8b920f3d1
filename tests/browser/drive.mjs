// Drives the system Chromium (no browser download) through playwright-core for
// tests/test_portable.py: runs every job of PLAN on harness.html, then uses the example page
// (examples/browser/index.html) as a person would, and writes what the browser computed.
//   node drive.mjs PLAN.json OUT.json
import { mkdtempSync, readFileSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { chromium } from "playwright-core";

const [planPath, outPath] = process.argv.slice(2);
const plan = JSON.parse(readFileSync(planPath, "utf8"));
const profile = mkdtempSync(join(tmpdir(), "knnper-chromium-")); // a fresh --user-data-dir
const errors = [];
const context = await chromium.launchPersistentContext(profile, {
  executablePath: plan.browser,
  headless: true,
  timeout: 60_000,
  args: ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"],
});
try {
  const page = context.pages()[0] ?? (await context.newPage());
  page.setDefaultTimeout(60_000);
  page.on("pageerror", (error) => errors.push(String(error)));
  const results = { jobs: {}, errors };
  await page.goto(plan.harness);
  await page.waitForFunction(() => window.harnessReady === true);
  for (const job of plan.jobs) {
    results.jobs[job.name] = await page.evaluate((j) => window.runJob(j), job);
  }
  if (plan.example) {
    const { url, image, label } = plan.example;
    const probabilities = async () => {
      await page.click("#predict");
      await page.waitForFunction(() => document.getElementById("probabilities").textContent);
      const text = await page.textContent("#probabilities");
      await page.evaluate(() => { document.getElementById("probabilities").textContent = ""; });
      return JSON.parse(text);
    };
    await page.goto(url);
    await page.waitForFunction(() => !/loading/.test(document.getElementById("status").textContent));
    const statusBefore = await page.textContent("#status");
    await page.setInputFiles("#image", image);
    await page.waitForFunction(() => !document.getElementById("predict").disabled);
    const before = await probabilities();
    await page.fill("#label", String(label));
    await page.click("#learn");
    await page.waitForFunction((s) => document.getElementById("status").textContent !== s,
                               statusBefore);
    results.example = { statusBefore, before, statusAfter: await page.textContent("#status"),
                        after: await probabilities() };
  }
  writeFileSync(outPath, JSON.stringify(results));
} finally {
  await context.close();
  rmSync(profile, { recursive: true, force: true });
}
