// Drives dsrun ui in Debian's Chromium through puppeteer-core (npm, installed into build/npm by
// ./setup.sh --with-test-tools) as a user would: a filter typed into the runs page and submitted
// with Enter, then every run ticked and compared. Prints what it saw as one JSON line.
// Usage: NODE_PATH=build/npm/node_modules node tests/ui_driver.js BASE_URL
const puppeteer = require('puppeteer-core');
(async () => {
  const [base] = process.argv.slice(2);
  const browser = await puppeteer.launch({executablePath: '/usr/lib/chromium/chromium', headless: true,
    args: ['--no-sandbox', '--disable-gpu', '--disable-dev-shm-usage']});
  const out = {};
  try {
    const page = await browser.newPage();
    await page.goto(base + '/', {waitUntil: 'load'});
    out.runs = await page.$$eval('input[name=run]', xs => xs.length);
    await page.type('input[name=where]', 'optimizer.lr > 0.002');
    await Promise.all([page.waitForNavigation({waitUntil: 'load'}), page.keyboard.press('Enter')]);
    out.filtered = await page.$$eval('input[name=run]', xs => xs.length);
    await page.goto(base + '/', {waitUntil: 'load'});
    for (const box of await page.$$('input[name=run]')) await box.click();
    await Promise.all([page.waitForNavigation({waitUntil: 'load'}), page.click('form[action="/compare"] button')]);
    await page.waitForSelector('#chart-loss polyline', {timeout: 5000});
    out.url = page.url();
    out.curves = await page.$$eval('#chart-loss polyline', xs => xs.length);
    out.differs = await page.$$eval('#config-diff tr.differs td:first-child', xs => xs.map(x => x.textContent));
  } finally {
    await browser.close();
  }
  console.log(JSON.stringify(out));
})().catch(e => { console.error(e); process.exit(1); });
